"""Transparent mode: plain OpenAI clients get TokenCake's stall handling with no code change.

An ASGI middleware for vLLM's OpenAI API server, loaded through its public ``--middleware``
option (``ServerConfig`` adds it to extension servers). For each ``POST /v1/chat/completions``
and ``POST /v1/responses`` it:

1. checks the client's key as vLLM will (a request vLLM refuses passes unread: it must not end
   another conversation's stalls), reads the body (at most ``max_body_bytes``) and finds the
   conversation: an explicit ``X-TokenCake-Session`` header, else ``previous_response_id``
   (Responses API), else the message list's fingerprint (``transparent.py``); a second request
   from one point of a conversation is a fork, a child conversation; none found: a new one;
2. ends the open tool calls the request answers (its tool results) — one ``stall_end`` per call,
   sent and acknowledged before the request goes on (bounded by ``timeout_s``) — and forwards the
   request with ``kv_transfer_params.tokencake`` (``RequestMeta``: its session, turn, predicted
   tool, and on the critical path once the conversation has called a tool: an agent loop);
3. passes the response through unchanged and unbuffered while reading it
   (``transparent_reply.py``); a reply with tool calls starts one ``stall_begin`` per call
   (stall id: the call id, made unique; tool: its function name) once the reply is complete,
   and the conversation's keys are stored before the last chunk reaches the client.

A request that carries ``kv_transfer_params.tokencake`` (the SDK) passes untouched, and so does
anything this layer cannot use: another route, a body that is not a JSON object, is larger than
the cap or nested too deeply to parse, a client vLLM will refuse (wrong API key), a request of no
known conversation that offers no tools (its reply cannot be a tool call). An events listener
that does not answer is logged once and counted; requests are then served as by stock vLLM.
Stalls are sent with ``node`` / ``agent_type`` ``transparent``: the core counts them
(``events.transparent_begin`` / ``events.transparent_end``) and learns tool durations per tool
name. ``GET /v1/tokencake/transparent`` answers this process's own counters (:data:`STATS_PATH`,
with the API's key).

Configuration comes from the API server process's environment (``transparent_events.py``;
without an events URL everything passes through). State is per API server process: with
``--api-server-count > 1`` a conversation may reach a process that has not seen it and is then
served as a new one.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
    answered_calls,
    chain,
    chat_entries,
    lookup_points,
    new_session_id,
    predict_next_tool,
    reply_keys,
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
from tokencake.serving.transparent_http import (
    ApiKeys,
    Message,
    Receive,
    Scope,
    Send,
    answer_json,
    header,
    replay,
    request_path,
    with_meta,
)
from tokencake.serving.transparent_reply import ReplyReader

__all__ = ["MIDDLEWARE", "ROUTES", "STATS_PATH", "TransparentMiddleware"]

log = logging.getLogger("tokencake.serving.transparent")

#: vLLM's ``--middleware`` value that loads this layer.
MIDDLEWARE = "tokencake.serving.transparent_asgi.TransparentMiddleware"
#: Routes read, by path (``root_path`` removed).
ROUTES = {"/v1/chat/completions": "chat", "/v1/responses": "responses"}
#: ``GET`` answers the middleware's counters (:meth:`TransparentMiddleware.stats`) as JSON.
STATS_PATH = "/v1/tokencake/transparent"
#: A kind of failure (a body too deep to parse, a request or reply not understood) is logged at
#: most this often; every occurrence is counted.
LOG_INTERVAL_S = 60.0


@dataclass
class _Turn:
    """One request of a conversation on its way through."""

    api: str
    conv: Conversation
    turn: int
    #: The conversation whose open calls it answers (``conv``, or the one it forked from).
    owner: Conversation
    #: The calls its arrival ends (those it answers).
    ended: list[OpenCall]
    #: The body to forward (emptied once handed to the app).
    body: bytes
    #: The chained digest of the request's entries (None: it had none).
    start: bytes | None


async def _delivered(delivery: Any) -> set[str]:
    """The stall ids a begin delivery recorded (empty if it failed or was cancelled)."""
    if delivery is None:
        return set()
    await asyncio.wait({delivery})
    if delivery.cancelled() or delivery.exception() is not None:
        return set()
    result: set[str] = delivery.result()
    return result


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
        #: The keys vLLM accepts (read from the app or the environment on the first request).
        self.api_keys = ApiKeys()
        self._logged: dict[str, float] = {}
        if self.events is None:
            log.warning("transparent mode: %s is not set; every request passes through", EVENTS_URL_ENV)
        else:
            log.info("transparent mode on: plain OpenAI conversations report stalls to %s", self.events.url)

    def stats(self) -> dict[str, Any]:
        """This process's counters: requests, conversations, events (JSON-able)."""
        events = self.events.counts if self.events is not None else {}
        return {
            **dict(sorted(self.counts.items())),
            "enabled": self.events is not None,
            "table": self.table.stats(),
            "events": dict(events),
        }

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def _log_limited(self, kind: str, message: str, *, exc_info: bool = False) -> None:
        """Log ``message`` (counted as ``kind``) at most once per :data:`LOG_INTERVAL_S`."""
        now = time.monotonic()
        last = self._logged.get(kind)
        if last is not None and now - last < LOG_INTERVAL_S:
            return
        self._logged[kind] = now
        count = self.counts.get(kind, 0)
        note = "transparent mode: %s (%s: %d so far, logged at most once a minute)"
        log.warning(note, message, kind, count, exc_info=exc_info)

    async def flush(self) -> None:
        """Wait until the begins being sent are delivered (or failed)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    # -- the request ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._is_stats(scope) and self.api_keys.allows(scope):
            await answer_json(send, self.stats())
            return
        api = self._route(scope)
        if api is None:
            await self.app(scope, receive, send)
            return
        self._count("requests")
        if not self.api_keys.allows(scope):  # vLLM refuses it: unread, it changes nothing here
            self._count("passed.unauthorized")
            await self.app(scope, receive, send)
            return
        received, body = await self._read(scope, receive)
        turn = self._plan_safely(api, scope, body) if body is not None else None
        del body
        if turn is None:
            await self.app(scope, replay(received, receive), send)
            return
        del received  # the buffers go with the replay: none is kept while the request runs
        await self._end_calls(turn)
        headers = list(scope.get("headers") or ())
        if any(k.lower() == b"content-length" for k, _v in headers):
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(turn.body)).encode()))
        first = [{"type": "http.request", "body": turn.body, "more_body": False}]
        turn.body = b""
        await self.app({**scope, "headers": headers}, replay(first, receive), self._watch(turn, send))

    def _is_stats(self, scope: Scope) -> bool:
        return (
            scope.get("type") == "http" and scope.get("method") == "GET" and request_path(scope) == STATS_PATH
        )

    def _route(self, scope: Scope) -> str | None:
        if self.events is None or scope.get("type") != "http" or scope.get("method") != "POST":
            return None
        return ROUTES.get(request_path(scope))

    async def _read(self, scope: Scope, receive: Receive) -> tuple[list[Message], bytes | None]:
        """The messages read and the whole body, or None for the body when it is too large or
        the client left (then the messages are replayed and the rest read by the app)."""
        cap = self.config.max_body_bytes
        length = header(scope, b"content-length")
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

    def _plan_safely(self, api: str, scope: Scope, body: bytes) -> _Turn | None:
        """:meth:`_plan`; what it cannot understand passes through, logged (rate-limited)."""
        try:
            return self._plan(api, scope, body)
        except RecursionError:  # JSON nested deeper than the parser's recursion limit
            self._count("passed.too_deep")
            self._log_limited("passed.too_deep", "a request body nested too deeply to read; passed through")
        except Exception:
            self._count("errors.plan")
            self._log_limited("errors.plan", "a request not understood; passed through", exc_info=True)
        return None

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
        entries = chat_entries(doc["messages"]) if api == "chat" else responses_entries(doc)
        digests = chain(entries)
        conv, owner, how = self._conversation(api, scope, doc, entries, digests)
        if owner is None and not _may_call_tools(doc):
            self._count("passed.no_tools")  # cannot end in a tool call: nothing to follow
            return None
        self._count(f"conversations.{how}")
        ended = owner.take_calls(answered_calls(api, doc)) if owner is not None else []
        turn = conv.turns
        conv.turns += 1
        tool = predict_next_tool(doc, conv.last_tool)
        meta = RequestMeta(
            session_id=conv.session_id,
            run_id=conv.run_id,
            node=TRANSPARENT_NODE,
            agent_type=TRANSPARENT_NODE,
            turn=turn,
            # A lone agent is its own critical path; a conversation is one from its first tool call.
            graph=GraphMeta(on_critical_path=conv.last_tool is not None),
            next_stall=NextStall(tool=tool) if tool else None,
        )
        self._count("injected")
        start = digests[-1] if digests else None
        return _Turn(api, conv, turn, owner or conv, ended, with_meta(body, doc, meta), start)

    def _conversation(
        self, api: str, scope: Scope, doc: dict[str, Any], entries: list[Any], digests: list[bytes]
    ) -> tuple[Conversation, Conversation | None, str]:
        """The request's conversation, the one whose calls it may answer (None: a new one), and
        how it was found."""
        named = (header(scope, SESSION_HEADER.lower().encode()) or "").strip()
        if 0 < len(named) <= 400:
            conv = self.table.session(named) or Conversation(named)
            self.table.record(conv)  # named by the client: kept (and its turns counted) at once
            return conv, conv, "header"
        found, how = None, "matched"
        previous = doc.get("previous_response_id") if api == "responses" else None
        if isinstance(previous, str):
            found, how = self.table.match([response_key(previous)]), "previous_response"
        if found is None:
            found, how = self.table.match(lookup_points(entries, digests)), "matched"
        if found is None:
            return Conversation(new_session_id()), None, "new"
        conv, key_turn = found
        if conv.continues(key_turn):
            return conv, conv, how
        return conv.fork(key_turn), conv, "forked"  # a second request from that point

    # -- stall events -----------------------------------------------------------------------------

    async def _end_calls(self, turn: _Turn) -> None:
        """End the calls the request answers before it goes on (bounded wait)."""
        if not turn.ended:
            return
        try:
            await asyncio.wait_for(self._post_ends(turn), timeout=self.config.timeout_s)
        except asyncio.TimeoutError:
            self._count("ends.timed_out")

    async def _post_ends(self, turn: _Turn) -> None:
        assert self.events is not None
        delivered: set[str] = set()
        for delivery in {id(c.delivery): c.delivery for c in turn.ended}.values():
            delivered |= await _delivered(delivery)
        now = time.monotonic()
        for call in turn.ended:
            if call.stall_id in delivered:  # else its begin never reached the listener
                await self.events.post(end_event(turn.owner, call, now), owed=True)

    async def _post_begins(self, conv: Conversation, calls: list[OpenCall], previous: Any) -> set[str]:
        """Send the begins of a turn's calls in order, after the conversation's earlier delivery
        (``previous``); the stall ids recorded."""
        assert self.events is not None
        if previous is not None:
            await asyncio.wait({previous})
        delivered = set()
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
                self._log_limited("errors.reply", "a reply not understood; passed through", exc_info=True)
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
        """The reply is complete: it stores the conversation's keys (before the client can send
        its next request) — a final reply too, once the conversation is followed, so that its
        next request continues it rather than forking — and a tool turn starts its begins."""
        reply = reader.turn()
        if reply is None:
            self._count("replies.unread")
            return
        conv = self._current(turn.conv)
        keys: list[bytes | str] = list(reply_keys(reply.entries, turn.start))
        if reply.response_id:
            keys.append(response_key(reply.response_id))
        if not reply.calls:
            self._count("replies.cut_off" if reply.cut_off else "replies.final")
            if conv.last_tool is not None:
                self.table.record(conv, keys, turn.turn)
            return
        now, sid = time.monotonic(), conv.session_id
        calls = [
            OpenCall(c.call_id, stall_id_for(c.call_id, sid, turn.turn), (c.name or "tool")[:200], now)
            for c in reply.calls
        ]
        conv.last_tool = calls[-1].tool
        self.table.record(conv, keys, turn.turn)
        task = asyncio.get_running_loop().create_task(self._post_begins(conv, calls, conv.pending))
        conv.pending = task
        conv.add_calls(c._replace(delivery=task) for c in calls)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._count("replies.tool_calls")
        self._count("tool_calls", len(calls))

    def _current(self, conv: Conversation) -> Conversation:
        """The table's object for ``conv``'s session: ``conv``, or the one that took its place
        while its request ran (a named session evicted, then named again), with ``conv``'s
        turns, open calls, keys and last tool merged in — never overwritten by the older one."""
        current = self.table.session(conv.session_id)
        if current is None or current is conv:
            return conv
        current.turns = max(current.turns, conv.turns)
        current.add_calls(c for c in conv.calls if c not in current.calls)
        conv.calls = []
        current.last_tool = current.last_tool or conv.last_tool
        for key, key_turn in conv.keys:
            self.table.record(current, [key], key_turn)
        self._count("conversations.merged")
        return current


def _may_call_tools(doc: Mapping[str, Any]) -> bool:
    """Whether the reply can be a tool call (tools offered, ``tool_choice`` not ``"none"``)."""
    tools = doc.get("tools")
    return isinstance(tools, list) and bool(tools) and doc.get("tool_choice") != "none"
