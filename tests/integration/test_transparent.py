"""Transparent mode on a real server: a plain ``openai.OpenAI`` tool loop, with no TokenCake import
on the client side, gets one stall per tool turn and its resumed prefixes served, not recomputed."""

from __future__ import annotations

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
FORCED = {"type": "function", "function": {"name": "get_weather"}}
TOOL_TURNS = 3


def test_a_plain_openai_tool_loop_gets_a_stall_per_tool_turn(tokencake_server: Server) -> None:
    srv = tokencake_server
    before = srv.stats()["counters"]
    oai = openai.OpenAI(base_url=srv.base_url, api_key="unused", timeout=180.0)
    messages: list[dict[str, object]] = [
        {
            "role": "user",
            "content": "What is the weather in Paris, Rome and Oslo? Ask the tool for each city.",
        }
    ]
    for turn in range(TOOL_TURNS):
        reply = oai.chat.completions.create(
            model=srv.model,
            messages=messages,
            tools=TOOLS,
            tool_choice=FORCED,
            temperature=0.0,
            max_tokens=64,
        )
        message = reply.choices[0].message
        assert message.tool_calls, reply
        # What such loops send back: the assistant's calls, then one result per call.
        messages.append(
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [c.model_dump() for c in message.tool_calls],
            }
        )
        for call in message.tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": f"Sunny, {20 + turn} degrees."}
            )
    final = oai.chat.completions.create(
        model=srv.model, messages=messages, tools=TOOLS, tool_choice="none", temperature=0.0, max_tokens=24
    )
    assert not final.choices[0].message.tool_calls
    after = srv.stats()["counters"]

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert delta("events.transparent_begin") == TOOL_TURNS  # one stall per tool-call turn ...
    assert delta("events.transparent_end") == TOOL_TURNS  # ... ended by the conversation's next request
    assert delta("events.inferred_end") == 0  # each end arrived before its request
    assert delta("next_turn.requests") == TOOL_TURNS  # each resumed turn was tied to its session
    prefix = delta("next_turn.prefix_tokens")
    served = delta("next_turn.prefix_tokens_device") + delta("next_turn.prefix_tokens_host")
    assert prefix > 0 and served == prefix  # the resumed prefix came from device or host
    assert delta("next_turn.prefix_tokens_recomputed") == 0
