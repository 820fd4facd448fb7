"""Transparent mode's ASGI middleware against a stand-in vLLM app and a stand-in events listener:
tool turns become stalls (JSON, SSE, parallel calls, Responses API), identity by fingerprint,
header and ``previous_response_id``, and everything it cannot use passes through untouched."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tokencake.serving.transparent_asgi import TransparentMiddleware
from tokencake.serving.transparent_events import EVENTS_URL_ENV, TransparentConfig
from tokencake.serving.transparent_http import ApiKeys

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
SYSTEM = {"role": "system", "content": "You answer with tools."}
USER = {"role": "user", "content": "Weather in Paris?"}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]

Reply = tuple[int, bytes, list[bytes]]
Call = tuple[str, str, dict[str, Any]]


class Sink:
    """The events listener: records each event (and the order against requests) and acks it."""

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log
        self.events: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.mode = "ok"

    async def handler(self, request: httpx.Request) -> httpx.Response:
        self.auth.append(request.headers.get("authorization"))
        if self.mode == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if self.mode == "slow":
            await asyncio.sleep(30)
        event = json.loads(request.content)
        self.events.append(event)
        self.log.append((event["type"], event["stall_id"]))
        return httpx.Response(200, json={"ok": True, "status": "recorded"})

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]


class FakeVLLM:
    """The API server behind the middleware: records each body, answers the next scripted reply."""

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log
        self.bodies: list[bytes] = []
        self.replies: deque[Reply] = deque()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        self.log.append(("request", len(self.bodies)))
        status, ctype, chunks = self.replies.popleft()
        await asyncio.sleep(0)  # let concurrent requests interleave
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]})
        for i, piece in enumerate(chunks):
            await send({"type": "http.response.body", "body": piece, "more_body": i < len(chunks) - 1})

    def meta(self, i: int = -1) -> dict[str, Any] | None:
        return json.loads(self.bodies[i]).get("kv_transfer_params", {}).get("tokencake")


class Rig:
    def __init__(self, **config: Any) -> None:
        self.log: list[tuple[str, Any]] = []
        self.sink = Sink(self.log)
        self.app = FakeVLLM(self.log)
        settings = {"events_url": "http://events.test", **config}
        self.mw = TransparentMiddleware(
            self.app, TransparentConfig(**settings), transport=httpx.MockTransport(self.sink.handler)
        )

    async def post(
        self,
        path: str,
        body: dict[str, Any] | bytes,
        reply: Reply | None = None,
        *,
        headers: list[tuple[bytes, bytes]] | None = None,
        pieces: int = 1,
        length: bool = True,
        on_body: Callable[[bytes], None] | None = None,
    ) -> tuple[int, list[bytes]]:
        if reply is not None:
            self.app.replies.append(reply)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = [(b"content-type", b"application/json"), *(headers or [])]
        if length:
            hdrs.append((b"content-length", str(len(raw)).encode()))
        scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": hdrs}
        size = -(-len(raw) // pieces) or 1
        parts = [raw[i : i + size] for i in range(0, len(raw), size)] or [b""]
        incoming = [
            {"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)
        ]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return incoming.pop(0) if incoming else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if on_body is not None and message["type"] == "http.response.body":
                on_body(message["body"])

        await self.mw(scope, receive, send)
        return sent[0]["status"], [m["body"] for m in sent[1:]]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def tool_call(call_id: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def assistant(calls: list[Call], content: str | None = None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": [tool_call(*c) for c in calls]}


def as_client_sends(calls: list[Call]) -> dict[str, Any]:
    """The assistant message as a client sends it back: keys reordered, arguments re-dumped."""
    return {
        "tool_calls": [
            {"function": {"arguments": json.dumps(args, indent=2), "name": name}, "id": cid}
            for cid, name, args in calls
        ],
        "role": "assistant",
        "content": "",
    }


def results(calls: list[Call]) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": cid, "content": f"result of {name}"} for cid, name, _a in calls]


def chat_json(calls: list[Call] | None = None, content: str | None = None) -> Reply:
    message = (
        assistant(calls or [], content) if calls else {"role": "assistant", "content": content or "Done."}
    )
    finish = "stop" if not calls else "tool_calls"
    doc = {"id": "chatcmpl-1", "choices": [{"index": 0, "message": message, "finish_reason": finish}]}
    return 200, b"application/json", [json.dumps(doc).encode()]


def chat_sse(calls: list[Call]) -> Reply:
    def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
        doc = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + json.dumps(doc).encode() + b"\n\n"

    chunks = [event({"role": "assistant", "content": ""})]
    for i, (cid, name, args) in enumerate(calls):
        chunks.append(
            event({"tool_calls": [{"index": i, "id": cid, "type": "function", "function": {"name": name}}]})
        )
        text = json.dumps(args)
        for part in (text[: len(text) // 2], text[len(text) // 2 :]):
            chunks.append(event({"tool_calls": [{"index": i, "function": {"arguments": part}}]}))
    chunks += [event({}, "tool_calls"), b"data: [DONE]\n\n"]
    return 200, b"text/event-stream", chunks


def function_call(call_id: str, name: str = "get_weather", *, server: bool = True) -> dict[str, Any]:
    item = {"type": "function_call", "call_id": call_id, "name": name, "arguments": '{"city": "Paris"}'}
    return {**item, "id": f"fc_{call_id}", "status": "completed"} if server else item


def responses_doc(resp_id: str, call_ids: list[str]) -> dict[str, Any]:
    return {"id": resp_id, "object": "response", "output": [function_call(c) for c in call_ids]}


def responses_json(resp_id: str, call_ids: list[str]) -> Reply:
    return 200, b"application/json", [json.dumps(responses_doc(resp_id, call_ids)).encode()]


def responses_sse(resp_id: str, call_ids: list[str]) -> Reply:
    def event(kind: str, **fields: Any) -> bytes:
        return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **fields}).encode() + b"\n\n"

    doc = responses_doc(resp_id, call_ids)
    chunks = [event("response.created", response={**doc, "output": []})]
    chunks += [event("response.output_item.done", item=item) for item in doc["output"]]
    chunks.append(event("response.completed", response=doc))
    return 200, b"text/event-stream", chunks


def test_a_tool_turn_then_its_next_request() -> None:
    rig = Rig()
    calls = [("call_a", "get_weather", {"city": "Paris", "unit": "C"})]

    async def scenario() -> None:
        first = {"model": "m", "messages": [SYSTEM, USER], "tools": TOOLS}
        reply = chat_json(calls)
        status, body = await rig.post(CHAT, first, reply)
        assert status == 200 and body == reply[2]  # the reply passes unchanged
        meta = rig.app.meta(0)
        assert meta is not None and meta["session_id"].startswith("transparent-")
        assert (meta["turn"], meta["node"], meta["agent_type"], meta["next_stall"]) == (
            0,
            "transparent",
            "transparent",
            None,  # two tools offered, none called yet: no prediction
        )
        forwarded = json.loads(rig.app.bodies[0])
        assert forwarded.pop("kv_transfer_params") == {"tokencake": meta}
        assert forwarded == first  # nothing else changed
        await rig.mw.flush()
        (begin,) = rig.sink.events
        assert begin["type"] == "stall_begin" and begin["stall_id"].startswith("call_a@")
        assert (begin["session_id"], begin["tool"], begin["node"]) == (
            meta["session_id"],
            "get_weather",
            "transparent",
        )

        second = {
            "model": "m",
            "messages": [SYSTEM, USER, as_client_sends(calls), *results(calls)],
            "tools": TOOLS,
        }
        await rig.post(CHAT, second, chat_json(content="Sunny."))
        meta2 = rig.app.meta(1)
        assert meta2 is not None and meta2["session_id"] == meta["session_id"] and meta2["turn"] == 1
        assert meta2["next_stall"]["tool"] == "get_weather"  # the conversation calls it again, likely
        end = rig.sink.events[1]
        assert end["type"] == "stall_end" and end["stall_id"] == begin["stall_id"] and end["duration_s"] >= 0
        assert rig.log.index(("stall_end", begin["stall_id"])) < rig.log.index(("request", 2))
        await rig.mw.flush()
        assert len(rig.sink.events) == 2  # a final answer begins nothing
        assert rig.mw.stats()["conversations.matched"] == 1

    run(scenario())


def test_a_streamed_turn_passes_chunk_by_chunk() -> None:
    rig = Rig()
    calls = [("call_s", "get_weather", {"city": "Rome"})]

    async def scenario() -> None:
        reply = chat_sse(calls)
        known_at_done: list[int] = []

        def on_body(chunk: bytes) -> None:
            if b"[DONE]" in chunk:  # the conversation is findable before the client can go on
                known_at_done.append(len(rig.mw.table))

        body = {"model": "m", "messages": [USER], "tools": TOOLS, "stream": True}
        status, chunks = await rig.post(CHAT, body, reply, on_body=on_body)
        assert status == 200 and chunks == reply[2]  # same chunks, same boundaries
        assert known_at_done == [1]
        await rig.mw.flush()
        assert [e["tool"] for e in rig.sink.of("stall_begin")] == ["get_weather"]
        nxt = {"model": "m", "messages": [USER, as_client_sends(calls), *results(calls)], "stream": True}
        await rig.post(CHAT, {**nxt, "tools": TOOLS}, chat_sse([("call_t", "get_time", {})]))
        assert rig.app.meta(1)["session_id"] == rig.app.meta(0)["session_id"]  # type: ignore[index]
        assert [e["stall_id"][:6] for e in rig.sink.of("stall_end")] == ["call_s"]
        await rig.mw.flush()
        assert [e["tool"] for e in rig.sink.of("stall_begin")] == ["get_weather", "get_time"]

    run(scenario())


def test_parallel_calls_each_begin_and_end() -> None:
    rig = Rig()
    calls = [("call_1", "get_weather", {"city": "Paris"}), ("call_2", "get_time", {"tz": "CET"})]

    async def scenario() -> None:
        await rig.post(CHAT, {"messages": [USER], "tools": TOOLS}, chat_json(calls))
        await rig.mw.flush()
        begins = rig.sink.of("stall_begin")
        assert [(b["stall_id"][:6], b["tool"]) for b in begins] == [
            ("call_1", "get_weather"),
            ("call_2", "get_time"),
        ]
        assert len({b["session_id"] for b in begins}) == 1
        await rig.post(
            CHAT, {"messages": [USER, as_client_sends(calls), *results(calls)], "tools": TOOLS}, chat_json()
        )
        ends = rig.sink.of("stall_end")
        assert sorted(e["stall_id"] for e in ends) == sorted(b["stall_id"] for b in begins)
        assert max(rig.log.index(("stall_end", e["stall_id"])) for e in ends) < rig.log.index(("request", 2))

    run(scenario())


def test_the_responses_api_by_fingerprint_and_by_response_id() -> None:
    rig = Rig()

    async def scenario() -> None:
        first = {"model": "m", "input": "Weather in Paris?", "tools": RESPONSES_TOOLS}
        await rig.post(RESPONSES, first, responses_json("resp_1", ["call_a"]))
        session = rig.app.meta(0)["session_id"]  # type: ignore[index]
        assert rig.app.meta(0)["next_stall"]["tool"] == "get_weather"  # type: ignore[index]  # the only tool
        await rig.mw.flush()
        # Stateless: the whole history as input (items without the server's id / status).
        history = [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "summary": []},
            function_call("call_a", server=False),
            {"type": "function_call_output", "call_id": "call_a", "output": "21 C"},
        ]
        await rig.post(RESPONSES, {**first, "input": history}, responses_sse("resp_2", ["call_b"]))
        assert rig.app.meta(1)["session_id"] == session  # type: ignore[index]
        assert [e["stall_id"][:6] for e in rig.sink.of("stall_end")] == ["call_a"]
        await rig.mw.flush()
        # Stateful: previous_response_id names the conversation.
        output = {"type": "function_call_output", "call_id": "call_b", "output": "22 C"}
        second = {"model": "m", "previous_response_id": "resp_2", "input": [output], "tools": RESPONSES_TOOLS}
        reply = (200, b"application/json", [json.dumps({"id": "resp_3", "output": []}).encode()])
        await rig.post(RESPONSES, second, reply)
        assert rig.app.meta(2)["session_id"] == session  # type: ignore[index]
        assert [e["stall_id"][:6] for e in rig.sink.of("stall_end")] == ["call_a", "call_b"]

    run(scenario())


def test_the_session_header_names_the_conversation_first() -> None:
    rig = Rig()
    calls = [("call_h", "get_weather", {"city": "Oslo"})]

    async def scenario() -> None:
        # A conversation found by fingerprint ...
        await rig.post(CHAT, {"messages": [USER], "tools": TOOLS}, chat_json(calls))
        fingerprinted = rig.app.meta(0)["session_id"]  # type: ignore[index]
        await rig.mw.flush()
        nxt = {"messages": [USER, as_client_sends(calls), *results(calls)], "tools": TOOLS}
        # ... is not the one a request naming another session continues.
        named = [(b"x-tokencake-session", b"chat-42")]
        await rig.post(CHAT, nxt, chat_json([("call_n", "get_time", {})]), headers=named)
        assert rig.app.meta(1)["session_id"] == "chat-42"  # type: ignore[index]
        assert rig.sink.of("stall_end") == []
        await rig.mw.flush()
        # The header keeps its session whatever the messages (a client that trims its history).
        trimmed = [USER, *results([("call_n", "get_time", {})])]
        await rig.post(CHAT, {"messages": trimmed, "tools": TOOLS}, chat_json(), headers=named)
        assert rig.app.meta(2)["session_id"] == "chat-42" and rig.app.meta(2)["turn"] == 1  # type: ignore[index]
        assert [e["session_id"] for e in rig.sink.of("stall_end")] == ["chat-42"]
        # Without it, the fingerprint finds the first conversation again.
        await rig.post(CHAT, nxt, chat_json())
        assert rig.app.meta(3)["session_id"] == fingerprinted  # type: ignore[index]
        assert [e["session_id"] for e in rig.sink.of("stall_end")] == ["chat-42", fingerprinted]

    run(scenario())


def test_a_request_with_client_metadata_passes_untouched() -> None:
    rig = Rig()
    body = {
        "messages": [USER],
        "tools": TOOLS,
        "kv_transfer_params": {"tokencake": {"session_id": "sdk-1", "run_id": "r", "node": "a"}},
        "priority": 3,
    }
    raw = json.dumps(body, indent=1).encode()

    async def scenario() -> None:
        await rig.post(
            CHAT, raw, chat_json([("call_x", "get_weather", {})]), headers=[(b"x-tokencake-session", b"s")]
        )
        await rig.mw.flush()

    run(scenario())
    assert rig.app.bodies == [raw] and rig.sink.events == [] and len(rig.mw.table) == 0
    assert rig.mw.stats()["passed.client_metadata"] == 1


def test_what_it_cannot_use_passes_untouched() -> None:
    rig = Rig(max_body_bytes=2048)
    tool_reply = chat_json([("call_z", "get_weather", {})])
    cases: list[tuple[str, bytes, dict[str, Any]]] = [
        (CHAT, b"{not json", {}),
        (CHAT, b"[1, 2]", {}),
        (CHAT, json.dumps({"messages": "hi", "tools": TOOLS}).encode(), {}),
        (CHAT, json.dumps({"messages": [USER], "tools": TOOLS, "kv_transfer_params": 7}).encode(), {}),
        (CHAT, json.dumps({"messages": [USER]}).encode(), {}),  # no tools: cannot be a tool turn
        (CHAT, json.dumps({"messages": [USER], "tools": TOOLS, "tool_choice": "none"}).encode(), {}),
        ("/v1/completions", json.dumps({"prompt": "x", "tools": TOOLS}).encode(), {}),
        (
            CHAT,
            json.dumps({"messages": [USER] * 40, "tools": TOOLS}).encode(),
            {"pieces": 5, "length": False},
        ),
        (CHAT, json.dumps({"messages": [USER] * 40, "tools": TOOLS}).encode(), {}),
    ]

    async def scenario() -> None:
        for path, raw, kwargs in cases:
            status, body = await rig.post(path, raw, tool_reply, **kwargs)
            assert status == 200 and body == tool_reply[2]
        await rig.mw.flush()

    run(scenario())
    assert rig.app.bodies == [raw for _p, raw, _k in cases]
    assert rig.sink.events == [] and len(rig.mw.table) == 0
    stats = rig.mw.stats()
    assert stats["passed.not_json"] == 2 and stats["passed.too_large"] == 2 and stats["passed.no_tools"] == 2
    assert stats.get("injected", 0) == 0


def test_a_listener_that_is_down_changes_nothing_but_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig()
    rig.sink.mode = "down"
    calls = [("call_d", "get_weather", {})]

    async def scenario() -> None:
        with caplog.at_level(logging.WARNING, logger="tokencake.serving.transparent"):
            reply = chat_json(calls)
            status, body = await rig.post(CHAT, {"messages": [USER], "tools": TOOLS}, reply)
            assert status == 200 and body == reply[2]
            await rig.mw.flush()
            nxt = {"messages": [USER, as_client_sends(calls), *results(calls)], "tools": TOOLS}
            await rig.post(CHAT, nxt, chat_json([("call_e", "get_weather", {})]))
            await rig.mw.flush()

    run(scenario())
    assert rig.sink.events == [] and len(rig.app.bodies) == 2
    assert rig.app.meta(1)["turn"] == 1  # type: ignore[index]  # still followed; only the events are lost
    events = rig.mw.stats()["events"]
    assert events["failed"] == 2 and "sent.stall_end" not in events  # no end for a begin never delivered
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "stall event" in r.getMessage()]
    assert len(warnings) == 1


def test_a_slow_listener_holds_a_request_back_briefly_at_most() -> None:
    rig = Rig(timeout_s=0.3)
    calls = [("call_w", "get_weather", {})]

    async def scenario() -> float:
        await rig.post(CHAT, {"messages": [USER], "tools": TOOLS}, chat_json(calls))
        await rig.mw.flush()
        rig.sink.mode = "slow"
        started = time.monotonic()
        nxt = {"messages": [USER, as_client_sends(calls), *results(calls)], "tools": TOOLS}
        status, _body = await rig.post(CHAT, nxt, chat_json())
        assert status == 200
        return time.monotonic() - started

    assert run(scenario()) < 2.0
    assert rig.mw.stats()["ends.timed_out"] == 1 and len(rig.app.bodies) == 2


def test_two_identical_first_requests_stay_two_conversations() -> None:
    rig = Rig()
    body = {"messages": [SYSTEM, USER], "tools": TOOLS}

    async def scenario(ids: tuple[str, str]) -> list[str]:
        replies = [chat_json([(cid, "get_weather", {"city": "Paris"})]) for cid in ids]
        rig.app.replies.extend(replies)
        await asyncio.gather(rig.post(CHAT, body), rig.post(CHAT, body))
        first = [rig.app.meta(-2)["session_id"], rig.app.meta(-1)["session_id"]]  # type: ignore[index]
        await rig.mw.flush()
        for cid in ids:
            calls = [(cid, "get_weather", {"city": "Paris"})]
            nxt = [SYSTEM, USER, as_client_sends(calls), *results(calls)]
            await rig.post(CHAT, {**body, "messages": nxt}, chat_json())
        return [*first, rig.app.meta(-2)["session_id"], rig.app.meta(-1)["session_id"]]  # type: ignore[index]

    a, b, next_a, next_b = run(scenario(("call_1", "call_2")))
    assert a != b and (next_a, next_b) == (a, b)  # each continues its own
    ended = [(e["session_id"], e["stall_id"][:6]) for e in rig.sink.of("stall_end")]
    assert sorted(ended) == sorted([(a, "call_1"), (b, "call_2")])
    # A model that numbers its call ids answers both alike: neither continuation may merge them.
    c, d, next_c, next_d = run(scenario(("functions.get_weather:0", "functions.get_weather:0")))
    assert len({c, d, next_c, next_d}) == 4
    assert len(rig.sink.of("stall_end")) == 2  # nothing more ended: both are left to expiry


def test_a_key_protected_server() -> None:
    rig = Rig(events_api_key="ev-key")
    rig.mw.api_keys = ApiKeys(["client-key"])  # vLLM's --api-key (read from the app or VLLM_API_KEY)
    named = [(b"x-tokencake-session", b"victim")]
    good = [*named, (b"authorization", b"Bearer client-key")]
    calls = [("call_k", "get_weather", {})]

    async def scenario() -> None:
        await rig.post(CHAT, {"messages": [USER], "tools": TOOLS}, chat_json(calls), headers=good)
        await rig.mw.flush()
        raw = json.dumps({"messages": [USER, *results(calls)], "tools": TOOLS}).encode()
        await rig.post(CHAT, raw, chat_json(), headers=[*named, (b"authorization", b"Bearer wrong")])
        assert rig.app.bodies[-1] == raw and rig.sink.of("stall_end") == []  # vLLM refuses it: no effect
        await rig.post(CHAT, raw, chat_json(), headers=good)
        assert len(rig.sink.of("stall_end")) == 1

    run(scenario())
    assert set(rig.sink.auth) == {"Bearer ev-key"}


def test_off_without_an_events_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EVENTS_URL_ENV, raising=False)
    rig = Rig(events_url=None)
    raw = json.dumps({"messages": [USER], "tools": TOOLS}).encode()

    async def scenario() -> None:
        await rig.post(CHAT, raw, chat_json([("call_o", "get_weather", {})]))
        await rig.mw.flush()

    run(scenario())
    assert rig.app.bodies == [raw] and rig.sink.events == [] and rig.mw.stats().get("requests", 0) == 0
    assert TransparentMiddleware(FakeVLLM([])).events is None  # the environment has no URL: off
    monkeypatch.setenv(EVENTS_URL_ENV, "http://e:1")
    assert TransparentMiddleware(FakeVLLM([])).events is not None


def test_sub_agents_forked_from_one_history_are_separate_sessions() -> None:
    """Two branches send the same history + tool result, each with its own task: the second is a
    child conversation, and one branch's next request ends only the calls it answers."""
    rig = Rig()
    root = [("call_root", "get_weather", {"city": "Paris"})]
    c1, c2 = [("call_b1", "get_time", {"tz": "CET"})], [("call_b2", "get_weather", {"city": "Rome"})]

    def meta_of(task: str) -> dict[str, Any]:
        (body,) = [json.loads(b) for b in rig.app.bodies if task.encode() in b]
        meta: dict[str, Any] = body["kv_transfer_params"]["tokencake"]
        return meta

    async def scenario() -> None:
        await rig.post(CHAT, {"messages": [SYSTEM, USER], "tools": TOOLS}, chat_json(root))
        await rig.mw.flush()
        shared = [SYSTEM, USER, as_client_sends(root), *results(root)]
        b1, b2 = ([*shared, {"role": "user", "content": f"branch {i}"}] for i in (1, 2))
        await rig.post(CHAT, {"messages": b1, "tools": TOOLS}, chat_json(c1))
        await rig.post(CHAT, {"messages": b2, "tools": TOOLS}, chat_json(c2))
        await rig.mw.flush()
        root_meta, one, two = rig.app.meta(0), meta_of("branch 1"), meta_of("branch 2")
        assert one["session_id"] == root_meta["session_id"] != two["session_id"]  # type: ignore[index]
        assert (one["turn"], two["turn"], two["next_stall"]["tool"]) == (1, 1, "get_time")  # inherited
        assert [e["stall_id"][:9] for e in rig.sink.of("stall_end")] == ["call_root"]  # ended once
        begins = {b["stall_id"][:7]: b["session_id"] for b in rig.sink.of("stall_begin")}
        assert (begins["call_b1"], begins["call_b2"]) == (one["session_id"], two["session_id"])
        # Branch 1's tool returned; branch 2's still runs: only branch 1's call ends.
        await rig.post(
            CHAT, {"messages": [*b1, as_client_sends(c1), *results(c1)], "tools": TOOLS}, chat_json()
        )
        assert [e["stall_id"][:7] for e in rig.sink.of("stall_end")] == ["call_ro", "call_b1"]
        await rig.post(
            CHAT, {"messages": [*b2, as_client_sends(c2), *results(c2)], "tools": TOOLS}, chat_json()
        )
        assert rig.app.meta(4)["session_id"] == two["session_id"]  # type: ignore[index]
        assert [e["session_id"] for e in rig.sink.of("stall_end")][2] == two["session_id"]

    run(scenario())
    assert rig.mw.stats()["conversations.forked"] == 1


def test_a_final_answer_then_a_follow_up_continues_the_conversation() -> None:
    rig = Rig()
    calls = [("call_f", "get_weather", {"city": "Oslo"})]

    async def scenario() -> None:
        await rig.post(CHAT, {"messages": [USER], "tools": TOOLS}, chat_json(calls))
        await rig.mw.flush()
        history = [USER, as_client_sends(calls), *results(calls)]
        await rig.post(CHAT, {"messages": history, "tools": TOOLS}, chat_json(content="Snow."))
        follow_up = [*history, {"role": "assistant", "content": "Snow.", "name": "bot"}, USER]
        await rig.post(CHAT, {"messages": follow_up, "tools": TOOLS}, chat_json())
        await rig.post(CHAT, {"messages": history, "tools": TOOLS}, chat_json())  # a regenerated answer

    run(scenario())
    sessions = [rig.app.meta(i)["session_id"] for i in range(4)]  # type: ignore[index]
    assert sessions[0] == sessions[1] == sessions[2] != sessions[3]  # the regeneration is a fork
    assert rig.app.meta(2)["turn"] == 2 and len(rig.sink.of("stall_end")) == 1  # type: ignore[index]


@pytest.mark.parametrize("interleaved", [True, False])
def test_responses_items_in_either_order_continue_the_conversation(interleaved: bool) -> None:
    rig = Rig()
    first = {
        "model": "m",
        "input": [{"role": "user", "content": "Paris and Rome?"}],
        "tools": RESPONSES_TOOLS,
    }
    outs = {
        c: {"type": "function_call_output", "call_id": c, "output": "sunny"} for c in ("call_a", "call_b")
    }
    if interleaved:  # for item in response.output: input += [item, its output] (OpenAI's docs loop)
        items = [x for c in outs for x in (function_call(c), outs[c])]
    else:
        items = [function_call("call_a"), function_call("call_b"), *outs.values()]

    async def scenario() -> None:
        await rig.post(RESPONSES, first, responses_json("resp_1", ["call_a", "call_b"]))
        await rig.mw.flush()
        await rig.post(RESPONSES, {**first, "input": first["input"] + items}, responses_json("resp_2", []))

    run(scenario())
    assert rig.app.meta(1)["session_id"] == rig.app.meta(0)["session_id"]  # type: ignore[index]
    assert sorted(e["stall_id"][:6] for e in rig.sink.of("stall_end")) == ["call_a", "call_b"]


def test_a_request_vllm_refuses_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "client-key")
    rig = Rig()
    raw = json.dumps({"messages": [USER], "tools": TOOLS}).encode()
    incoming = [{"type": "http.request", "body": raw, "more_body": False}]
    reads: list[str] = []

    async def receive() -> dict[str, Any]:
        reads.append("read")
        return incoming.pop(0)

    async def app(scope: dict[str, Any], app_receive: Any, send: Any) -> None:
        assert not reads and app_receive is receive  # handed on untouched, unread
        assert (await app_receive())["body"] == raw
        await send({"type": "http.response.start", "status": 401, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message: dict[str, Any]) -> None:
        pass

    rig.mw.app = app
    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": [(b"authorization", b"Bearer no")]}
    run(rig.mw(scope, receive, send))
    assert rig.mw.stats()["passed.unauthorized"] == 1


def test_a_body_too_deeply_nested_passes_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig()
    raw = (
        b'{"messages": [{"role": "user", "content": "x"}], "tools": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    )

    async def scenario() -> None:
        with caplog.at_level(logging.INFO, logger="tokencake.serving.transparent"):
            for _ in range(3):
                status, _body = await rig.post(CHAT, raw, chat_json())
                assert status == 200

    run(scenario())
    lines = [
        r
        for r in caplog.records
        if r.name == "tokencake.serving.transparent" and r.levelno >= logging.WARNING
    ]
    assert len(lines) == 1 and not lines[0].exc_info and "\n" not in lines[0].getMessage()
    assert rig.app.bodies == [raw] * 3 and rig.mw.stats()["passed.too_deep"] == 3


def test_a_utf16_body_stays_valid_json() -> None:
    rig = Rig()
    raw = json.dumps({"model": "m", "messages": [USER], "tools": TOOLS}).encode("utf-16-le")
    run(rig.post(CHAT, raw, chat_json()))
    assert json.loads(rig.app.bodies[0])["messages"] == [USER] and rig.app.meta(0) is not None


def test_a_named_session_evicted_while_its_request_runs_is_merged_not_overwritten() -> None:
    rig = Rig(max_conversations=1)
    alice = [(b"x-tokencake-session", b"alice")]
    gate = asyncio.Event()
    fake = rig.app

    async def slow_first(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (b"x-slow", b"1") in scope["headers"]:
            await gate.wait()
        await fake(scope, receive, send)

    rig.mw.app = slow_first

    async def scenario() -> None:
        slow = asyncio.create_task(
            rig.post(CHAT, {"messages": [USER], "tools": TOOLS}, headers=[*alice, (b"x-slow", b"1")])
        )
        await asyncio.sleep(0.01)
        await rig.post(CHAT, {"messages": [USER], "tools": TOOLS}, headers=[(b"x-tokencake-session", b"bob")])
        fake.replies.extend([chat_json([("call_1", "get_weather", {})]), chat_json()])
        fake.replies.appendleft(chat_json([("call_2", "get_time", {})]))  # alice's newer turn, answered first
        await rig.post(CHAT, {"messages": [USER, USER], "tools": TOOLS}, headers=alice)
        newer = rig.mw.table.session("alice")
        gate.set()
        await slow
        await rig.mw.flush()
        current = rig.mw.table.session("alice")
        assert current is newer and current is not None
        assert sorted(c.call_id for c in current.calls) == ["call_1", "call_2"] and current.turns == 1

    rig.app.replies.append(chat_json())  # bob's
    run(scenario())
    assert rig.mw.stats()["conversations.merged"] == 1


def test_no_request_buffer_is_kept_while_the_app_runs() -> None:
    rig = Rig()
    held: list[list[str]] = []

    def big_bytes(obj: Any, depth: int = 0) -> bool:
        if isinstance(obj, (bytes, bytearray)):
            return len(obj) > 10_000
        if depth > 3:
            return False
        if isinstance(obj, dict):
            return any(big_bytes(v, depth + 1) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return any(big_bytes(v, depth + 1) for v in obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return any(big_bytes(v, depth + 1) for v in vars(obj).values())
        return False

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        held.append(sorted(k for k, v in outer.cr_frame.f_locals.items() if big_bytes(v)))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def noop(message: dict[str, Any]) -> None:
        pass

    rig.mw.app = app
    for tools in (TOOLS, []):  # forwarded with metadata; passed through
        raw = json.dumps({"messages": [{"role": "user", "content": "x" * 50_000}], "tools": tools}).encode()
        incoming = [{"type": "http.request", "body": raw[:30_000], "more_body": True},
                    {"type": "http.request", "body": raw[30_000:], "more_body": False}]  # fmt: skip

        async def receive(incoming: list[dict[str, Any]] = incoming) -> dict[str, Any]:
            return incoming.pop(0)

        scope = {"type": "http", "method": "POST", "path": CHAT, "headers": []}
        outer = rig.mw(scope, receive, noop)
        run(outer)
    assert held == [[], []]


def test_a_streamed_call_cut_off_begins_no_stall() -> None:
    rig = Rig()
    status, ctype, chunks = chat_sse([("call_cut", "get_weather", {"city": "Paris"})])
    end = b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}\n\n'
    cut = [*chunks[:-3], end, b"data: [DONE]\n\n"]  # half its arguments, then max_tokens

    async def scenario() -> None:
        await rig.post(CHAT, {"messages": [USER], "tools": TOOLS, "stream": True}, (status, ctype, cut))
        await rig.mw.flush()

    run(scenario())
    assert rig.sink.events == [] and len(rig.mw.table) == 0 and rig.mw.stats()["replies.cut_off"] == 1


def test_the_critical_path_starts_at_the_first_tool_call() -> None:
    """A request is marked critical once its conversation has called a tool (an agent loop):
    a conversation's first request, or one that never called a tool, is not."""
    rig = Rig()
    calls = [("call_c", "get_weather", {})]
    named = [(b"x-tokencake-session", b"chatty")]

    async def scenario() -> None:
        await rig.post(CHAT, {"messages": [USER], "tools": TOOLS}, chat_json(calls))
        await rig.mw.flush()
        await rig.post(CHAT, {"messages": [USER, as_client_sends(calls), *results(calls)], "tools": TOOLS},
                       chat_json())  # fmt: skip
        for _ in range(2):
            await rig.post(CHAT, {"messages": [USER], "tools": TOOLS}, chat_json(), headers=named)

    run(scenario())
    critical = [rig.app.meta(i)["graph"]["on_critical_path"] for i in range(4)]  # type: ignore[index]
    assert critical == [False, True, False, False]


def test_the_counters_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig()

    async def get(headers: list[tuple[bytes, bytes]]) -> tuple[int, Any]:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b""}

        scope = {"type": "http", "method": "GET", "path": "/v1/tokencake/transparent/", "headers": headers}
        await rig.mw(scope, receive, send)
        return sent[0]["status"], sent[1]["body"]

    run(rig.post(CHAT, {"messages": [USER], "tools": TOOLS}, chat_json()))
    status, body = run(get([]))
    stats = json.loads(body)
    assert (
        status == 200 and stats["requests"] == 1 and stats["enabled"] and stats["table"]["conversations"] == 0
    )
    rig.mw.api_keys = ApiKeys(["k"])  # with a key: only for its holders; others get vLLM's answer
    assert json.loads(run(get([(b"authorization", b"Bearer k")]))[1])["injected"] == 1
    assert run(get([]))[1] == b"{}"  # the stand-in app's
