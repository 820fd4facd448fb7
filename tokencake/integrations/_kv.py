"""What the server did with a tool call's KV, for the frameworks' own traces.

A TokenCake server answers every chat completion with ``kv_transfer_params.tokencake_kv``: where
the prompt's KV came from when the request was admitted (``docs/architecture.md``,
``request_finished``). The request that resumes a conversation after a tool call therefore says
what happened to that conversation's KV while the tool ran. :class:`Resumes` pairs each tool call
with the response of the turn it resumed; :func:`kv_report` turns the provenance into the flat
attributes every adapter attaches to its framework's trace (``docs/integrations.md`` lists them).
Streamed responses carry no ``kv_transfer_params``: their tool calls get no report.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

import tokencake as tc

#: The key of the server's provenance in a response's ``kv_transfer_params``.
PROVENANCE_KEY = "tokencake_kv"
#: Provenance counters copied into every report as they are.
_COUNTERS = ("prompt_tokens", "prefetched_tokens", "admissions", "failed_copy_tokens", "failed_load_tokens")


def provenance(kv_transfer_params: Any) -> dict[str, int] | None:
    """The ``tokencake_kv`` entry of a response's ``kv_transfer_params``, None when absent."""
    if not isinstance(kv_transfer_params, Mapping):
        return None
    found = kv_transfer_params.get(PROVENANCE_KEY)
    if not isinstance(found, Mapping):
        return None
    return {str(k): int(v) for k, v in found.items() if isinstance(v, int | float)}


def kv_report(kv: Mapping[str, int], context_tokens: int | None = None) -> dict[str, Any]:
    """The server's decision for a resumed turn, from its provenance ``kv``.

    ``decision`` is ``loaded`` (KV read back from host memory on demand when the turn arrived),
    ``prefetched`` (moved out during the tool call and back before the turn), ``kept`` (it stayed
    on the GPU) or ``recomputed`` (none of it was found). ``context_tokens`` is the conversation's
    length before the tool call (the previous request's prompt and completion); with it,
    ``recomputed_tokens`` counts the part of that context computed again.
    """
    device = int(kv.get("device_tokens", 0))
    host = int(kv.get("host_tokens", 0))
    prefetched = int(kv.get("prefetched_tokens", 0))
    decision = (
        "loaded" if host > 0 else "prefetched" if prefetched > 0 else "kept" if device > 0 else "recomputed"
    )
    report: dict[str, Any] = {
        "decision": decision,
        "offloaded": host > 0 or prefetched > 0,
        "kept_tokens": max(device - prefetched, 0),
        "loaded_tokens": host,
        **{key: int(kv.get(key, 0)) for key in _COUNTERS},
    }
    if context_tokens is not None:
        known = min(context_tokens, report["prompt_tokens"] or context_tokens)
        report["recomputed_tokens"] = max(known - device - host, 0)
    return report


@dataclass(frozen=True)
class ToolCallRef:
    """One finished tool call waiting for its conversation's next turn.

    ``span`` is the framework's handle on the tool call's own span (an OpenAI Agents span, an
    OpenTelemetry span context), for attaching the report under it.
    """

    session_id: str
    tool: str
    stall_id: str
    tool_call_id: str | None = None
    span: Any = None

    def fields(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "tool_call_id": self.tool_call_id,
            "stall_id": self.stall_id,
            "session_id": self.session_id,
        }


class Resumes:
    """Pairs tool calls with the response of the turn that resumed them, per session.

    ``ended`` records a finished tool call; ``resumed`` takes a session's next response and returns
    each waiting tool call with its report (tool identity plus :func:`kv_report`). Bounded: the
    least recently seen sessions are forgotten past ``max_sessions``.
    """

    def __init__(self, max_sessions: int = 4096) -> None:
        self.max_sessions = max_sessions
        self._waiting: OrderedDict[str, list[ToolCallRef]] = OrderedDict()
        self._context: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def ended(self, call: ToolCallRef) -> None:
        with self._lock:
            self._waiting.setdefault(call.session_id, []).append(call)
            self._touch(self._waiting, call.session_id)

    def resumed(
        self, session_id: str, kv: Mapping[str, int] | None, *, prompt_tokens: int, completion_tokens: int
    ) -> list[tuple[ToolCallRef, dict[str, Any]]]:
        """The tool calls ``session_id``'s response resumed, each with its report (none without ``kv``)."""
        with self._lock:
            waiting = self._waiting.pop(session_id, [])
            before = self._context.get(session_id)
            if prompt_tokens or completion_tokens:
                self._context[session_id] = prompt_tokens + completion_tokens
                self._touch(self._context, session_id)
        if kv is None:
            return []
        report = kv_report(kv, before)
        return [(call, {**call.fields(), **report}) for call in waiting]

    def _touch(self, table: OrderedDict[str, Any], key: str) -> None:
        table.move_to_end(key)
        while len(table) > self.max_sessions:
            table.popitem(last=False)


def otel_attributes(report: Mapping[str, Any]) -> dict[str, Any]:
    """``report`` as OpenTelemetry attributes: ``tokencake.kv.<key>``, None values left out."""
    return {f"tokencake.kv.{key}": value for key, value in report.items() if value is not None}


def read_response(body: Mapping[str, Any]) -> tuple[dict[str, int] | None, int, int]:
    """(provenance, prompt tokens, completion tokens) of a chat completion's JSON body."""
    usage = body.get("usage") if isinstance(body.get("usage"), Mapping) else {}
    return (
        provenance(body.get("kv_transfer_params")),
        int(usage.get("prompt_tokens") or 0),
        int(usage.get("completion_tokens") or 0),
    )


class KvTransport(httpx.AsyncBaseTransport, httpx.BaseTransport):
    """Wraps a ``tc.TokenCakeTransport``: each non-streamed chat completion's response resumes its
    session's tool calls (``resumes``), whose reports go to ``emit`` (sync requests) or ``aemit``
    (async requests, awaited).

    ``session`` finds the request's session, as the wrapped transport's source does (it is called
    in the request's context); a request of no session, or a streamed response, passes untouched.
    """

    def __init__(
        self,
        transport: tc.TokenCakeTransport,
        session: Callable[[], tc.Session | None],
        resumes: Resumes,
        emit: Callable[[ToolCallRef, dict[str, Any]], None],
        aemit: Callable[[ToolCallRef, dict[str, Any]], Awaitable[None]],
    ) -> None:
        self._transport = transport
        self._session = session
        self._resumes = resumes
        self._emit = emit
        self._aemit = aemit

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._transport.handle_async_request(request)
        session = self._session() if _is_chat(request) else None
        if session is not None and _is_json(response):
            await response.aread()
            for call, report in self._resumed(session, response):
                await self._aemit(call, report)
        return response

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._transport.handle_request(request)
        session = self._session() if _is_chat(request) else None
        if session is not None and _is_json(response):
            response.read()
            for call, report in self._resumed(session, response):
                self._emit(call, report)
        return response

    def _resumed(
        self, session: tc.Session, response: httpx.Response
    ) -> list[tuple[ToolCallRef, dict[str, Any]]]:
        try:
            body = json.loads(response.content)
        except ValueError:
            return []
        if not isinstance(body, Mapping):
            return []
        kv, prompt, completion = read_response(body)
        return self._resumes.resumed(
            session.session_id, kv, prompt_tokens=prompt, completion_tokens=completion
        )

    async def aclose(self) -> None:
        await self._transport.aclose()

    def close(self) -> None:
        self._transport.close()


def _is_chat(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.rstrip("/").endswith("/chat/completions")


def _is_json(response: httpx.Response) -> bool:
    return response.status_code == 200 and "json" in response.headers.get("content-type", "")
