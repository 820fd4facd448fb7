"""``tools=`` against the real server with the real openai client (what every agent SDK sends)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jsonschema
import openai
import pytest

from tokencake.serving import Server

pytestmark = pytest.mark.integration

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "forced_tool_calls.py"
_spec = importlib.util.spec_from_file_location("forced_tool_calls", _BENCH)
assert _spec is not None and _spec.loader is not None
forced = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(forced)

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


#: Forced turns of ``benchmarks/forced_tool_calls.py`` (its 50 turns: the acceptance measurement):
#: required and named, one to three tools, enums, bounded integers, arrays, a nested object.
FORCED_TURNS = (0, 3, 4, 10, 27, 31, 33, 46)


def test_forced_tool_choice_gives_schema_valid_calls(tokencake_server: Server) -> None:
    """``tool_choice="required"`` and a named function: every reply is a call whose arguments
    validate against the tool's schema (unconstrained, the bundled model wrote ``<tool_call>``
    text with arguments outside the schema until ``max_tokens``)."""
    oai = client(tokencake_server)
    for turn in FORCED_TURNS:
        body = forced.turn_request(turn, tokencake_server.model)
        reply = oai.chat.completions.create(**body).model_dump()
        assert forced.check_reply(body, reply) is None, (turn, reply["choices"][0])
        assert not reply["choices"][0]["message"]["content"]  # the call is parsed, no raw tags left


def test_a_forced_call_streams(tokencake_server: Server) -> None:
    body = forced.turn_request(4, tokencake_server.model)  # place_order: a nested address object
    stream = client(tokencake_server).chat.completions.create(**body, stream=True)
    names, arguments, text = [], "", ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or []:
            if call.function and call.function.name:
                names.append(call.function.name)
            arguments += (call.function.arguments or "") if call.function else ""
    assert names == ["place_order"] and "<tool_call>" not in text
    jsonschema.validate(json.loads(arguments), body["tools"][0]["function"]["parameters"])
