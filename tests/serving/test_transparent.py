"""Transparent mode's conversation fingerprints and table: re-serialised conversations match,
diverging ones never merge, the table is bounded and holds no message text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokencake.serving.transparent import (
    KEYS_PER_CONVERSATION,
    OPEN_CALLS_PER_CONVERSATION,
    TRANSPARENT_NODE,
    Conversation,
    ConversationTable,
    OpenCall,
    answered_calls,
    chain,
    chat_entries,
    chat_message_entry,
    lookup_points,
    new_session_id,
    predict_next_tool,
    reply_keys,
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
    (key,) = reply_keys([chat_message_entry(reply)], start[-1] if start else None)
    return key


def lookup_keys(messages: list[Any]) -> list[bytes]:
    entries = chat_entries(messages)
    return lookup_points(entries, chain(entries))


def matched(table: ConversationTable, keys: list[Any]) -> Conversation | None:
    found = table.match(keys)
    return found[0] if found is not None else None


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
    assert matched(table, lookup_keys(nxt)) is conv


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
    # The assistant message: fields a client adds or drops (``name``) do not count; its calls do.
    named = {**server_reply("c", {"x": 1}), "name": "weather-bot"}
    assert chat_message_entry(named) == chat_message_entry(server_reply("c", {"x": 1}))
    assert chat_message_entry(server_reply("c", {"x": 1})) != chat_message_entry(server_reply("d", {"x": 1}))
    assert chat_message_entry(server_reply("c", {"x": 1})) != chat_message_entry(server_reply("c", {"x": 2}))
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
        assert matched(table, lookup_keys(nxt)) is conv
    # Only the opening in common: a new conversation.
    assert matched(table, lookup_keys([SYSTEM, USER])) is None


def test_a_key_two_conversations_produced_finds_neither() -> None:
    """A model that numbers its call ids answers two identical requests identically."""
    table = ConversationTable()
    key = stored_key([SYSTEM, USER], server_reply("functions.get_weather:0", {"city": "Paris"}))
    a, b = Conversation("a"), Conversation("b")
    table.record(a, [key])
    table.record(b, [key])
    assert matched(table, [key]) is None
    table.record(a, [key])  # stays ambiguous
    assert matched(table, [key]) is None
    assert table.stats()["collisions"] == 1


def test_the_latest_tool_call_position_matches_first() -> None:
    table = ConversationTable()
    first, second = Conversation("first"), Conversation("second")
    turn1 = [SYSTEM, USER, server_reply("c1", {}), {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    table.record(first, [stored_key([SYSTEM, USER], server_reply("c1", {}))])
    table.record(second, [stored_key(turn1, server_reply("c2", {}))])
    turn2 = [*turn1, server_reply("c2", {}), {"role": "tool", "tool_call_id": "c2", "content": "y"}]
    assert matched(table, lookup_keys(turn2)) is second
    assert matched(table, lookup_keys(turn1)) is first


def test_the_table_is_bounded_least_recently_used_first() -> None:
    table = ConversationTable(max_conversations=3)
    convs = [Conversation(f"s{i}") for i in range(5)]
    for i, conv in enumerate(convs[:3]):
        table.record(conv, [f"k{i}"])
    assert matched(table, ["k0"]) is convs[0]  # used: s1 is now the oldest
    for i, conv in enumerate(convs[3:], start=3):
        table.record(conv, [f"k{i}"])
    assert len(table) == 3
    assert table.session("s1") is None and matched(table, ["k1"]) is None
    assert table.session("s2") is None and matched(table, ["k2"]) is None
    assert matched(table, ["k0"]) is convs[0]
    assert table.stats() == {"conversations": 3, "keys": 3, "evicted": 2, "collisions": 0}
    with pytest.raises(ValueError):
        ConversationTable(max_conversations=0)


def test_a_conversation_keeps_its_recent_keys_only() -> None:
    table = ConversationTable()
    conv = Conversation("s")
    for i in range(KEYS_PER_CONVERSATION + 3):
        table.record(conv, [f"k{i}"])
    assert matched(table, ["k0"]) is None and matched(table, ["k2"]) is None
    assert matched(table, [f"k{KEYS_PER_CONVERSATION + 2}"]) is conv
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
    conv.calls = [OpenCall("call_1", "call_1@x.0", "get_weather", 1.0)]
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


def test_a_request_takes_only_the_calls_it_answers() -> None:
    conv = Conversation("s")
    a, b = OpenCall("call_a", "call_a@t.0", "f", 0.0), OpenCall("call_b", "call_b@t.0", "g", 0.0)
    conv.add_calls([a, b])
    assert conv.take_calls({"call_b", "call_x"}) == [b] and conv.calls == [a]
    assert conv.take_calls(set()) == [] and conv.calls == [a]
    assert conv.take_calls({"call_a"}) == [a] and conv.calls == []
    # Calls nobody answers stay open, but only so many (the oldest go to the core's expiry).
    conv.add_calls(OpenCall(f"c{i}", f"c{i}@t.0", "f", 0.0) for i in range(OPEN_CALLS_PER_CONVERSATION + 5))
    assert len(conv.calls) == OPEN_CALLS_PER_CONVERSATION and conv.calls[0].call_id == "c5"


def test_answered_calls() -> None:
    messages = [
        USER,
        server_reply("call_a", {}),
        {"role": "tool", "tool_call_id": "call_a", "content": "x"},
        {"role": "tool", "tool_call_id": 7},
        {"role": "user", "tool_call_id": "not_a_result"},
        "junk",
    ]
    assert answered_calls("chat", {"messages": messages}) == {"call_a"}
    assert answered_calls("chat", {"messages": "hi"}) == set()
    items = [
        {"type": "function_call", "call_id": "call_a", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "x"},
        {"type": "function_call_output", "call_id": "call_b", "output": "y"},
        {"role": "user", "content": "hi"},
    ]
    assert answered_calls("responses", {"input": items}) == {"call_a", "call_b"}
    assert answered_calls("responses", {"input": "hi"}) == set()


def test_a_key_continues_its_conversation_once() -> None:
    """The second request from one point of a conversation (sub-agents forked from one history,
    a regenerated answer) is a fork: a child conversation with a session of its own."""
    table = ConversationTable()
    conv = Conversation("s", last_tool="get_weather")
    conv.turns = 1  # turn 0 ran; its reply stored the key
    table.record(conv, ["k0"], turn=0)
    found = table.match(["k0"])
    assert found == (conv, 0) and conv.continues(0)
    conv.turns += 1  # the first continuation (turn 1) is in flight
    assert not conv.continues(0)  # a second one from the same key forks
    child = conv.fork(0)
    assert child.session_id != conv.session_id and child.session_id.startswith(f"{TRANSPARENT_NODE}-")
    assert (child.turns, child.last_tool, list(child.keys), child.calls) == (1, "get_weather", [], [])
    table.record(conv, ["k1"], turn=1)  # turn 1's reply
    assert table.match(["k1", "k0"]) == (conv, 1) and conv.continues(1)  # the latest key: continues


def test_a_reply_stores_a_key_at_each_call_and_at_its_end() -> None:
    """A Responses API client may append all calls, then all outputs, or interleave them: both
    pass a stored key."""
    request = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    calls = [
        {"type": "function_call", "call_id": c, "name": "get_weather", "arguments": "{}"}
        for c in ("ca", "cb")
    ]
    outputs = [{"type": "function_call_output", "call_id": c, "output": "sunny"} for c in ("ca", "cb")]
    start = chain(responses_entries({"input": request}))[-1]
    reply = [e for e in (responses_item_entry(item) for item in calls) if e is not None]
    table = ConversationTable()
    conv = Conversation("s")
    table.record(conv, reply_keys(reply, start), turn=0)
    assert len(conv.keys) == 2
    for order in (
        [*request, *calls, *outputs],
        [*request, calls[0], outputs[0], calls[1], outputs[1]],
        [*request, calls[0], outputs[0]],
    ):
        entries = responses_entries({"input": order})
        assert table.match(lookup_points(entries, chain(entries))) == (conv, 0), order
    # Many calls: the first ones and the end, at most half a conversation's keys.
    many = [responses_item_entry({**calls[0], "call_id": f"c{i}"}) for i in range(40)]
    keys = reply_keys([e for e in many if e is not None], start)
    assert len(keys) == KEYS_PER_CONVERSATION // 2
    assert keys[-1] == chain([e for e in many if e is not None], start)[-1]
    assert reply_keys([], start) == []


def test_a_final_answer_is_a_lookup_position_too() -> None:
    """A followed conversation's final reply stores a key: the next request continues from it."""
    final = {"role": "assistant", "content": "Sunny."}
    entry = chat_message_entry(final)
    assert entry.reply and not entry.call and not chat_message_entry(USER).reply
    messages = [SYSTEM, USER, final, {"role": "user", "content": "And tomorrow?"}]
    start = chain(chat_entries([SYSTEM, USER]))[-1]
    assert lookup_keys(messages)[0] == reply_keys([entry], start)[0]
