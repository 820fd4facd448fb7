"""Transparent mode's reply reader: tool calls from JSON and SSE replies of both APIs, fed in any
chunking; what it cannot read (too large, broken, an error event) gives no reply."""

from __future__ import annotations

import json
from typing import Any

from tokencake.serving.transparent import chat_message_entry, responses_item_entry
from tokencake.serving.transparent_reply import ReplyReader, SeenCall, chat_reply, responses_reply


def sse(*events: Any, done: bool = True) -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


PARALLEL_STREAM = sse(
    chunk({"role": "assistant", "content": ""}),
    chunk(
        {
            "tool_calls": [
                {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather"}}
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    chunk(
        {"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time"}}]}
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    chunk({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}),
    chunk({"content": "a second choice", "tool_calls": []}, index=1),
    chunk({}, finish="tool_calls"),
    {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 10}},
)


def read(
    api: str, body: bytes, *, stream: bool, step: int | None = None, max_bytes: int = 1 << 20
) -> ReplyReader:
    reader = ReplyReader(api, stream=stream, max_bytes=max_bytes)
    step = step or len(body)
    for i in range(0, len(body), step):
        reader.feed(body[i : i + step])
    return reader


def test_a_json_chat_reply() -> None:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    doc = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}  # a named tool_choice
    reader = read("chat", json.dumps(doc).encode(), stream=False, step=7)
    turn = reader.turn()
    assert turn is not None and turn.calls == [SeenCall("call_a", "f")]
    assert turn.entries == [chat_message_entry(message)]
    assert (
        chat_reply({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}).calls == []
    )  # type: ignore[union-attr]
    assert chat_reply({"choices": []}) is None and chat_reply("x") is None


def test_a_streamed_chat_reply_in_any_chunking() -> None:
    expected = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_a", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }
    for step in (1, 3, 64, None):
        reader = read("chat", PARALLEL_STREAM, stream=True, step=step)
        assert reader.complete
        turn = reader.turn()
        assert turn is not None, step
        assert turn.calls == [SeenCall("call_a", "get_weather"), SeenCall("call_b", "get_time")]
        assert turn.entries == [chat_message_entry(expected)]
    crlf = read("chat", PARALLEL_STREAM.replace(b"\n", b"\r\n"), stream=True, step=5)
    assert crlf.turn() == read("chat", PARALLEL_STREAM, stream=True).turn()


def test_the_terminal_event_completes_a_stream() -> None:
    body = PARALLEL_STREAM
    head, tail = body[: body.index(b"data: [DONE]")], body[body.index(b"data: [DONE]") :]
    reader = read("chat", head, stream=True)
    assert not reader.complete and reader.turn() is None
    reader.feed(tail)
    assert reader.complete and reader.turn() is not None


def test_a_responses_reply() -> None:
    out = [
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_a",
            "name": "lookup",
            "arguments": "{}",
            "status": "completed",
        },
    ]
    doc = {"id": "resp_1", "object": "response", "output": out}
    turn = read("responses", json.dumps(doc).encode(), stream=False).turn()
    assert turn is not None and turn.calls == [SeenCall("call_a", "lookup")] and turn.response_id == "resp_1"
    assert turn.entries == [responses_item_entry(out[1])]
    events = (
        b"event: response.created\ndata: "
        + json.dumps({"type": "response.created", "response": {"id": "resp_1", "output": []}}).encode()
        + b"\n\nevent: response.completed\ndata: "
        + json.dumps({"type": "response.completed", "response": doc}).encode()
        + b"\n\n"
    )
    reader = read("responses", events, stream=True, step=11)
    assert reader.complete and reader.turn() == turn
    assert responses_reply({"output": "x"}) is None


def test_what_cannot_be_read_gives_no_reply() -> None:
    assert read("chat", b"{not json", stream=False).turn() is None
    assert read("chat", b"data: {broken\n\n", stream=True).turn() is None
    error = sse({"error": {"message": "boom", "code": 500}})
    assert read("chat", error, stream=True).turn() is None
    failed = b"data: " + json.dumps({"type": "response.failed", "response": {}}).encode() + b"\n\n"
    assert read("responses", failed, stream=True).turn() is None
    # Over the cap: a JSON body, or a stream's reply so far, is dropped (and nothing more kept).
    big = json.dumps({"choices": [{"index": 0, "message": {"content": "x" * 5000}}]}).encode()
    reader = read("chat", big, stream=False, step=100, max_bytes=1000)
    assert reader.broken and reader.turn() is None and not reader._buffer
    long_stream = sse(*[chunk({"content": "y" * 100}) for _ in range(50)])
    assert read("chat", long_stream, stream=True, max_bytes=1000).turn() is None
    # An unfinished event larger than the cap.
    assert read("chat", b"data: " + b"z" * 5000, stream=True, max_bytes=1000).broken


def test_a_reply_cut_off_has_no_calls() -> None:
    """``max_tokens`` reached mid-call: the arguments are incomplete, the client cannot run it."""
    cut = PARALLEL_STREAM.replace(b'"finish_reason": "tool_calls"', b'"finish_reason": "length"')
    assert cut != PARALLEL_STREAM
    turn = read("chat", cut, stream=True, step=9).turn()
    assert turn is not None and turn.calls == [] and turn.cut_off and len(turn.entries) == 1
    message = {
        "role": "assistant",
        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": '{"a'}}],
    }
    doc = {"choices": [{"index": 0, "message": message, "finish_reason": "length"}]}
    assert chat_reply(doc).calls == []  # type: ignore[union-attr]
    done = {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]}
    assert chat_reply(done).calls  # type: ignore[union-attr]
    out = [{"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a'}]
    assert responses_reply({"id": "r", "status": "incomplete", "output": out}).calls == []  # type: ignore[union-attr]
    assert responses_reply({"id": "r", "status": "completed", "output": out}).calls  # type: ignore[union-attr]
