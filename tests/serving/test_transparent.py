"""Transparent mode's conversation fingerprints and table: re-serialised conversations match,
diverging ones never merge, the table is bounded and holds no message text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokencake.serving.transparent import (
    KEYS_PER_CONVERSATION,
    TRANSPARENT_NODE,
    Conversation,
    ConversationTable,
    OpenCall,
    call_points,
    chain,
    chat_entries,
    chat_message_entry,
    new_session_id,
    predict_next_tool,
    response_key,
    responses_entries,
    responses_item_entry,
    stall_id_for,
)

SYSTEM = {"role": "system", "content": "You are a weather agent."}
USER = {"role": "user", "content": "Weather in Paris and Rome?"}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


def server_reply(call_id: str, args: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as vLLM returns it."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(args)},
            }
        ],
    }


def reserialised(call_id: str, args: dict[str, Any]) -> dict[str, Any]:
    """The same message as a client sends it back: other key order, spacing, extra fields."""
    return {
        "content": "",
        "refusal": None,
        "role": "assistant",
        "reasoning_content": None,
        "tool_calls": [
            {
                "function": {
                    "arguments": json.dumps(dict(reversed(list(args.items()))), indent=1),
                    "name": "get_weather",
                },
                "id": call_id,
                "type": "function",
            }
        ],
    }


def stored_key(messages: list[Any], reply: dict[str, Any]) -> bytes:
    """The key the middleware stores after a tool turn: request + the reply's message."""
    start = chain(chat_entries(messages))
    entries = [chat_message_entry(reply)]
    return call_points(entries, chain(entries, start[-1] if start else None))[0]


def lookup_keys(messages: list[Any]) -> list[bytes]:
    entries = chat_entries(messages)
    return call_points(entries, chain(entries))


def test_a_reserialised_conversation_matches() -> None:
    args = {"city": "Paris", "unit": "celsius"}
    table = ConversationTable()
    conv = Conversation("s1")
    table.record(conv, [stored_key([SYSTEM, USER], server_reply("call_a", args))])
    nxt = [
        {"role": "system", "content": [{"type": "text", "text": "You are a weather agent."}]},
        USER,
        reserialised("call_a", args),
        {"role": "tool", "tool_call_id": "call_a", "content": "21 C"},
    ]
    assert table.match(lookup_keys(nxt)) is conv


def test_canonical_forms() -> None:
    assert chat_message_entry({"role": "user", "content": None}) == chat_message_entry(
        {"role": "user", "content": ""}
    )
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert chat_message_entry(parts) == chat_message_entry({"role": "user", "content": "ab"})
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:1"}}]}
    other = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:2"}}]}
    assert chat_message_entry(image) != chat_message_entry(other)
    assert chat_message_entry(server_reply("c", {"x": 1})).call
    assert not chat_message_entry(USER).call
    # Unparseable arguments are compared as sent.
    broken = server_reply("c", {})
    broken["tool_calls"][0]["function"]["arguments"] = "{not json"
    assert chat_message_entry(broken).call


def test_diverging_conversations_sharing_their_opening_never_merge() -> None:
    table = ConversationTable()
    a, b = Conversation("a"), Conversation("b")
    # Two identical first requests; the server answers each with its own call id.
    table.record(a, [stored_key([SYSTEM, USER], server_reply("call_1", {"city": "Paris"}))])
    table.record(b, [stored_key([SYSTEM, USER], server_reply("call_2", {"city": "Paris"}))])
    for conv, call_id in ((a, "call_1"), (b, "call_2")):
        nxt = [
            SYSTEM,
            USER,
            server_reply(call_id, {"city": "Paris"}),
            {"role": "tool", "tool_call_id": call_id},
        ]
        assert table.match(lookup_keys(nxt)) is conv
    # Only the opening in common: a new conversation.
    assert table.match(lookup_keys([SYSTEM, USER])) is None


def test_a_key_two_conversations_produced_finds_neither() -> None:
    """A model that numbers its call ids answers two identical requests identically."""
    table = ConversationTable()
    key = stored_key([SYSTEM, USER], server_reply("functions.get_weather:0", {"city": "Paris"}))
    a, b = Conversation("a"), Conversation("b")
    table.record(a, [key])
    table.record(b, [key])
    assert table.match([key]) is None
    table.record(a, [key])  # stays ambiguous
    assert table.match([key]) is None
    assert table.stats()["collisions"] == 1


def test_the_latest_tool_call_position_matches_first() -> None:
    table = ConversationTable()
    first, second = Conversation("first"), Conversation("second")
    turn1 = [SYSTEM, USER, server_reply("c1", {}), {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    table.record(first, [stored_key([SYSTEM, USER], server_reply("c1", {}))])
    table.record(second, [stored_key(turn1, server_reply("c2", {}))])
    turn2 = [*turn1, server_reply("c2", {}), {"role": "tool", "tool_call_id": "c2", "content": "y"}]
    assert table.match(lookup_keys(turn2)) is second
    assert table.match(lookup_keys(turn1)) is first


def test_the_table_is_bounded_least_recently_used_first() -> None:
    table = ConversationTable(max_conversations=3)
    convs = [Conversation(f"s{i}") for i in range(5)]
    for i, conv in enumerate(convs[:3]):
        table.record(conv, [f"k{i}"])
    assert table.match(["k0"]) is convs[0]  # used: s1 is now the oldest
    for i, conv in enumerate(convs[3:], start=3):
        table.record(conv, [f"k{i}"])
    assert len(table) == 3
    assert table.session("s1") is None and table.match(["k1"]) is None
    assert table.session("s2") is None and table.match(["k2"]) is None
    assert table.match(["k0"]) is convs[0]
    assert table.stats() == {"conversations": 3, "keys": 3, "evicted": 2, "collisions": 0}
    with pytest.raises(ValueError):
        ConversationTable(max_conversations=0)


def test_a_conversation_keeps_its_recent_keys_only() -> None:
    table = ConversationTable()
    conv = Conversation("s")
    for i in range(KEYS_PER_CONVERSATION + 3):
        table.record(conv, [f"k{i}"])
    assert table.match(["k0"]) is None and table.match(["k2"]) is None
    assert table.match([f"k{KEYS_PER_CONVERSATION + 2}"]) is conv
    assert table.stats()["keys"] == KEYS_PER_CONVERSATION


def _strings(obj: Any, seen: set[int] | None = None) -> list[str]:
    """Every str and bytes reachable from ``obj`` (attributes, containers)."""
    seen = seen if seen is not None else set()
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, bytes):
        return [obj.decode("latin-1")]
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _strings(k, seen) + _strings(v, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
        for v in obj:
            out += _strings(v, seen)
    elif hasattr(obj, "__dict__"):
        out += _strings(vars(obj), seen)
    return out


def test_the_table_holds_no_message_text() -> None:
    secret = "the launch code is 0451"
    messages = [SYSTEM, {"role": "user", "content": secret}]
    table = ConversationTable()
    conv = Conversation("s")
    conv.calls = [OpenCall("call_1@x.0", "get_weather", 1.0)]
    conv.last_tool = "get_weather"
    table.record(conv, [stored_key(messages, server_reply("call_1", {"q": secret}))])
    held = _strings(table)
    assert held and not any("launch code" in s or "0451" in s for s in held)


def test_responses_items_canonical_forms() -> None:
    assert responses_entries({"input": "hi"}) == responses_entries(
        {"input": [{"role": "user", "content": "hi"}]}
    )
    typed = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    assert responses_entries({"input": [typed]}) == responses_entries({"input": "hi"})
    out_call = {"type": "function_call", "id": "fc_9", "status": "completed", "call_id": "call_1",
                "name": "get_weather", "arguments": '{"b": 1, "a": 2}'}  # fmt: skip
    in_call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"a":2,"b":1}',
    }
    assert responses_item_entry(out_call) == responses_item_entry(in_call)
    assert responses_item_entry(out_call).call  # type: ignore[union-attr]
    assert responses_item_entry({"type": "reasoning", "summary": []}) is None
    with_instructions = responses_entries({"instructions": "be brief", "input": "hi"})
    assert len(with_instructions) == 2 and with_instructions[1:] == responses_entries({"input": "hi"})


def test_predict_next_tool() -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    assert predict_next_tool({"tools": TOOLS, "tool_choice": named}, None) == "get_time"
    assert predict_next_tool(
        {"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}}, None
    ) == ("get_time")
    assert predict_next_tool({"tools": TOOLS[:1]}, None) == "get_weather"
    assert predict_next_tool({"tools": TOOLS}, None) is None
    assert predict_next_tool({"tools": TOOLS}, "get_time") == "get_time"
    assert predict_next_tool({"tools": TOOLS}, "gone") is None
    assert predict_next_tool({"tools": TOOLS[:1], "tool_choice": "none"}, "get_weather") is None
    assert predict_next_tool({}, "get_weather") is None
    responses_tools = [{"type": "function", "name": "lookup"}]
    assert predict_next_tool({"tools": responses_tools}, None) == "lookup"


def test_ids() -> None:
    sid = new_session_id()
    assert sid.startswith(f"{TRANSPARENT_NODE}-") and sid != new_session_id()
    a = stall_id_for("functions.search:0", "s1", 0)
    assert a.startswith("functions.search:0@")
    assert (
        len({a, stall_id_for("functions.search:0", "s1", 1), stall_id_for("functions.search:0", "s2", 0)})
        == 3
    )
    assert len(stall_id_for("x" * 500, "s" * 400, 10**9)) <= 200
    assert stall_id_for("", "s", 0).startswith("call@")
    assert response_key("resp_1") == "r:resp_1"
    conv = Conversation("s" * 300)
    assert len(conv.run_id) == 200
    conv.calls, conv.pending = [OpenCall("c", "t", 0.0)], object()
    calls, pending = conv.take_calls()
    assert calls and pending is not None and conv.calls == [] and conv.pending is None
