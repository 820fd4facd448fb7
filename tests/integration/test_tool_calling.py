"""``tools=`` against the real server with the real openai client (what every agent SDK sends)."""

from __future__ import annotations

import json

import openai
import pytest

from tokencake.serving import Server

pytestmark = pytest.mark.integration

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "the city"}},
                "required": ["city"],
            },
        },
    }
]


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120.0)


def test_auto_tool_choice_is_accepted(tokencake_server: Server) -> None:
    """The OpenAI default tool_choice ("auto") used to be HTTP 400 on `tokencake serve`."""
    reply = client(tokencake_server).chat.completions.create(
        model=tokencake_server.model,
        messages=[{"role": "user", "content": "What is the weather in Paris? Use the tool."}],
        tools=TOOLS,
        tool_choice="auto",
        temperature=0.0,
        max_tokens=48,
    )
    choice = reply.choices[0]
    # A 135M model may answer in prose or call the tool; either way it is a valid completion, and
    # a call, if any, is parsed into the structured field (never left as raw tags in the text).
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    assert "<tool_call>" not in (choice.message.content or "") or not choice.message.tool_calls


def test_a_conversation_holding_tool_results_continues(tokencake_server: Server) -> None:
    """An assistant turn with tool_calls (content null) and the tool's result render and complete."""
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees Celsius."},
    ]
    reply = client(tokencake_server).chat.completions.create(
        model=tokencake_server.model, messages=messages, tools=TOOLS, temperature=0.0, max_tokens=32
    )
    assert reply.usage is not None and reply.usage.prompt_tokens > 60  # tools + call + result rendered
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
