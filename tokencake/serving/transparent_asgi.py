"""Transparent mode: plain OpenAI clients get TokenCake's stall handling with no code change.

An ASGI middleware for vLLM's OpenAI API server, loaded through its public ``--middleware``
option (``ServerConfig`` adds it to extension servers). For each ``POST /v1/chat/completions``
and ``POST /v1/responses`` it:

1. reads the body (at most ``max_body_bytes``) and finds the conversation: an explicit
   ``X-TokenCake-Session`` header, else ``previous_response_id`` (Responses API), else the
   message list's fingerprint (``transparent.py``); none found: a new conversation;
2. ends the conversation's open tool calls — one ``stall_end`` per call, sent and acknowledged
   before the request goes on (bounded by ``timeout_s``) — and forwards the request with
   ``kv_transfer_params.tokencake`` (``RequestMeta``: its session, turn and predicted tool);
3. passes the response through unchanged and unbuffered while reading it
   (``transparent_reply.py``); a reply with tool calls starts one ``stall_begin`` per call
   (stall id: the call id, made unique; tool: its function name) once the reply is complete,
   and the conversation's key is stored before the last chunk reaches the client.

A request that carries ``kv_transfer_params.tokencake`` (the SDK) passes untouched, and so does
anything this layer cannot use: another route, a body that is not a JSON object or is larger than
the cap, a client vLLM will refuse (wrong API key), a request of no known conversation that offers
no tools (its reply cannot be a tool call). An events listener that does not answer is logged
once and counted; requests are then served as by stock vLLM. Stalls are sent with ``node`` /
``agent_type`` ``transparent``: the core counts them (``events.transparent_begin`` /
``events.transparent_end``) and learns tool durations per tool name.

Configuration comes from the API server process's environment (``transparent_events.py``;
without an events URL everything passes through). State is per API server process: with
``--api-server-count > 1`` a conversation may reach a process that has not seen it and is then
served as a new one.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from tokencake.events import META_KEY, GraphMeta, NextStall, RequestMeta
from tokencake.serving.transparent import (
    SESSION_HEADER,
    TRANSPARENT_NODE,
    Conversation,
    ConversationTable,
    OpenCall,
    call_points,
    chain,
    chat_entries,
    new_session_id,
    predict_next_tool,
    response_key,
    responses_entries,
    stall_id_for,
)
from tokencake.serving.transparent_events import (
    EVENTS_URL_ENV,
    EventPoster,
    TransparentConfig,
    begin_event,
    end_event,
)
from tokencake.serving.transparent_reply import ReplyReader

__all__ = ["MIDDLEWARE", "ROUTES", "TransparentMiddleware"]

log = logging.getLogger("tokencake.serving.transparent")

#: vLLM's ``--middleware`` value that loads this layer.
MIDDLEWARE = "tokencake.serving.transparent_asgi.TransparentMiddleware"
#: Routes read, by path (``root_path`` removed).
ROUTES = {"/v1/chat/completions": "chat", "/v1/responses": "responses"}

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass
class _Turn:
    """One request of a conversation on its way through."""

    api: str
    conv: Conversation
    turn: int
    #: The calls its arrival ends and the delivery of their begins.
    ended: list[OpenCall]
    pending: Any
    body: bytes
    #: The chained digest of the request's entries (None: it had none).
    start: bytes | None


async def _delivered(pending: Any) -> set[str]:
    """The stall ids a begin delivery recorded (empty if it failed or was cancelled)."""
    if pending is None:
        return set()
    await asyncio.wait({pending})
    if pending.cancelled() or pending.exception() is not None:
        return set()
    result: set[str] = pending.result()
    return result


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


class TransparentMiddleware:
    """The ASGI layer (see the module docstring); vLLM builds it with ``cls(app)``."""

    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        config: TransparentConfig | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.app = app
        self.config = config if config is not None else TransparentConfig.from_env()
        self.table = ConversationTable(self.config.max_conversations)
        self.events = EventPoster(self.config, transport) if self.config.events_url else None
        self.counts: dict[str, int] = {}
        self._tasks: set[asyncio.Task[set[str]]] = set()
        self._api_keys: list[bytes] | None = None
        if self.events is None:
            log.warning("transparent mode: %s is not set; every request passes through", EVENTS_URL_ENV)
        else:
            log.info("transparent mode on: plain OpenAI conversations report stalls to %s", self.events.url)

    def stats(self) -> dict[str, Any]:
        """This process's counters: requests, conversations, events (JSON-able)."""
        events = self.events.counts if self.events is not None else {}
        return {**dict(sorted(self.counts.items())), "table": self.table.stats(), "events": dict(events)}

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    async def flush(self) -> None:
        """Wait until the begins being sent are delivered (or failed)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    # -- the request ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = self._route(scope)
        if api is None:
            await self.app(scope, receive, send)
            return
        self._count("requests")
        received, body = await self._read(scope, receive)
        turn = None
        if body is not None:
            try:
                turn = self._plan(api, scope, body)
            except Exception:
                self._count("errors.plan")
                log.exception("transparent mode: request not understood; passed through")
        if turn is None:
            await self.app(scope, _replay(received, receive), send)
            return
        await self._end_calls(turn)
        headers = list(scope.get("headers") or ())
        if any(k.lower() == b"content-length" for k, _v in headers):
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(turn.body)).encode()))
        new_body = {"type": "http.request", "body": turn.body, "more_body": False}
        await self.app({**scope, "headers": headers}, _replay([new_body], receive), self._watch(turn, send))

    def _route(self, scope: Scope) -> str | None:
        if self.events is None or scope.get("type") != "http" or scope.get("method") != "POST":
            return None
        path = str(scope.get("path", ""))
        root = str(scope.get("root_path", ""))
        if root and path.startswith(root):
            path = path[len(root) :]
        return ROUTES.get(path.rstrip("/"))

    async def _read(self, scope: Scope, receive: Receive) -> tuple[list[Message], bytes | None]:
        """The messages read and the whole body, or None for the body when it is too large or
        the client left (then the messages are replayed and the rest read by the app)."""
        cap = self.config.max_body_bytes
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > cap:
            self._count("passed.too_large")
            return [], None
        received: list[Message] = []
        size = 0
        while True:
            message = await receive()
            received.append(message)
            if message.get("type") != "http.request":
                self._count("passed.disconnected")
                return received, None
            size += len(message.get("body", b""))
            if size > cap:
                self._count("passed.too_large")
                return received, None
            if not message.get("more_body", False):
                return received, b"".join(m.get("body", b"") for m in received)

    def _plan(self, api: str, scope: Scope, body: bytes) -> _Turn | None:
        """The conversation this request continues and its new body; None: pass it through.
        Synchronous, so no other request sees the table half updated."""
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            self._count("passed.not_json")
            return None
        kv = doc.get("kv_transfer_params")
        if isinstance(kv, dict) and META_KEY in kv:
            self._count("passed.client_metadata")
            return None
        if kv is not None and not isinstance(kv, dict):
            self._count("passed.bad_kv_transfer_params")
            return None
        if api == "chat" and not isinstance(doc.get("messages"), list):
            self._count("passed.no_messages")
            return None
        if not self._authorized(scope):
            self._count("passed.unauthorized")
            return None
        entries = chat_entries(doc["messages"]) if api == "chat" else responses_entries(doc)
        digests = chain(entries)
        conv, how = self._conversation(api, scope, doc, entries, digests)
        if how == "new" and not _may_call_tools(doc):
            self._count("passed.no_tools")  # cannot end in a tool call: nothing to follow
            return None
        self._count(f"conversations.{how}")
        ended, pending = conv.take_calls()
        turn = conv.turns
        conv.turns += 1
        tool = predict_next_tool(doc, conv.last_tool)
        meta = RequestMeta(
            session_id=conv.session_id,
            run_id=conv.run_id,
            node=TRANSPARENT_NODE,
            agent_type=TRANSPARENT_NODE,
            turn=turn,
            graph=GraphMeta(on_critical_path=True),  # a lone agent is its own critical path
            next_stall=NextStall(tool=tool) if tool else None,
        )
        self._count("injected")
        start = digests[-1] if digests else None
        return _Turn(api, conv, turn, ended, pending, _with_meta(body, doc, meta), start)

    def _conversation(
        self, api: str, scope: Scope, doc: dict[str, Any], entries: list[Any], digests: list[bytes]
    ) -> tuple[Conversation, str]:
        named = (_header(scope, SESSION_HEADER.lower().encode()) or "").strip()
        if 0 < len(named) <= 400:
            conv = self.table.session(named) or Conversation(named)
            self.table.record(conv, ())  # named by the client: kept (and its turns counted) at once
            return conv, "header"
        previous = doc.get("previous_response_id") if api == "responses" else None
        if isinstance(previous, str):
            conv = self.table.match([response_key(previous)])
            if conv is not None:
                return conv, "previous_response"
        conv = self.table.match(call_points(entries, digests))
        if conv is not None:
            return conv, "matched"
        return Conversation(new_session_id()), "new"

    def _authorized(self, scope: Scope) -> bool:
        """Whether vLLM will accept the request's key (its own rule: ``--api-key``, else
        ``VLLM_API_KEY``). A refused request must not end another conversation's stalls."""
        if self._api_keys is None:
            args = getattr(getattr(scope.get("app"), "state", None), "args", None)
            keys = list(getattr(args, "api_key", None) or []) or [os.environ.get("VLLM_API_KEY") or ""]
            self._api_keys = [k.encode() for k in keys if k]
        if not self._api_keys:
            return True
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return any(hmac.compare_digest(token.encode(), key) for key in self._api_keys)

    # -- stall events -----------------------------------------------------------------------------

    async def _end_calls(self, turn: _Turn) -> None:
        """End the conversation's open calls before its request goes on (bounded wait)."""
        if not turn.ended and turn.pending is None:
            return
        try:
            await asyncio.wait_for(self._post_ends(turn), timeout=self.config.timeout_s)
        except asyncio.TimeoutError:
            self._count("ends.timed_out")

    async def _post_ends(self, turn: _Turn) -> None:
        assert self.events is not None
        delivered = await _delivered(turn.pending)
        now = time.monotonic()
        for call in turn.ended:
            if call.stall_id in delivered:  # else its begin never reached the listener
                await self.events.post(end_event(turn.conv, call, now), owed=True)

    async def _post_begins(self, conv: Conversation, calls: list[OpenCall], previous: Any) -> set[str]:
        """Send the begins of a turn's calls in order; the stall ids recorded (with those of an
        earlier delivery still open, ``previous``)."""
        assert self.events is not None
        delivered = await _delivered(previous)
        for call in calls:
            if await self.events.post(begin_event(conv, call)):
                delivered.add(call.stall_id)
        return delivered

    # -- the response -----------------------------------------------------------------------------

    def _watch(self, turn: _Turn, send: Send) -> Send:
        """``send`` that reads the reply as it passes; every message goes on unchanged."""
        reader: ReplyReader | None = None
        finished = False

        async def watched(message: Message) -> None:
            nonlocal reader, finished
            try:
                if message.get("type") == "http.response.start":
                    reader = self._reader(turn, message)
                elif message.get("type") == "http.response.body" and reader is not None and not finished:
                    reader.feed(message.get("body", b""))
                    if reader.complete or not message.get("more_body", False):
                        finished = True
                        self._finish(turn, reader)
            except Exception:
                finished = True
                self._count("errors.reply")
                log.exception("transparent mode: reply not understood; passed through")
            await send(message)

        return watched

    def _reader(self, turn: _Turn, start: Message) -> ReplyReader | None:
        if start.get("status") != 200:
            return None
        headers = {bytes(k).lower(): bytes(v).decode("latin-1") for k, v in start.get("headers") or ()}
        if headers.get(b"content-encoding", "identity") != "identity":
            return None
        stream = headers.get(b"content-type", "").startswith("text/event-stream")
        return ReplyReader(turn.api, stream=stream, max_bytes=self.config.max_body_bytes)

    def _finish(self, turn: _Turn, reader: ReplyReader) -> None:
        """The reply is complete: a tool turn stores the conversation's key (before the client can
        send its next request) and starts its begins."""
        reply = reader.turn()
        if reply is None:
            self._count("replies.unread")
            return
        if not reply.calls:
            self._count("replies.final")
            return
        conv = turn.conv
        now = time.monotonic()
        calls = [
            OpenCall(stall_id_for(c.call_id, conv.session_id, turn.turn), (c.name or "tool")[:200], now)
            for c in reply.calls
        ]
        keys: list[bytes | str] = call_points(reply.entries, chain(reply.entries, turn.start))[:1]
        if reply.response_id:
            keys.append(response_key(reply.response_id))
        conv.last_tool = calls[-1].tool
        conv.calls = conv.calls + calls  # a concurrent branch's calls stay open too
        self.table.record(conv, keys)
        task = asyncio.get_running_loop().create_task(self._post_begins(conv, calls, conv.pending))
        conv.pending = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._count("replies.tool_calls")
        self._count("tool_calls", len(calls))


def _may_call_tools(doc: Mapping[str, Any]) -> bool:
    """Whether the reply can be a tool call (tools offered, ``tool_choice`` not ``"none"``)."""
    tools = doc.get("tools")
    return isinstance(tools, list) and bool(tools) and doc.get("tool_choice") != "none"


def _with_meta(body: bytes, doc: dict[str, Any], meta: RequestMeta) -> bytes:
    """``body`` with ``kv_transfer_params.tokencake`` added; the client's bytes are kept when it
    sent no ``kv_transfer_params`` (the field is spliced in front)."""
    fields = meta.model_dump(mode="json", exclude={"stall_events"})
    stripped = body.lstrip()
    if "kv_transfer_params" not in doc and stripped[:1] == b"{":
        head = b'{"kv_transfer_params":' + json.dumps({META_KEY: fields}).encode()
        return head + (b"," if doc else b"") + stripped[1:]
    kv = doc.get("kv_transfer_params") or {}
    return json.dumps({**doc, "kv_transfer_params": {**kv, META_KEY: fields}}).encode()


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that returns ``messages`` first, then reads on (disconnects included)."""
    queue = list(messages)

    async def replayed() -> Message:
        if queue:
            return queue.pop(0)
        return await receive()

    return replayed
