"""Per-LLM-call records, taken at the HTTP layer under the SDK's OpenAI client.

:class:`CallRecorder` is an ``httpx`` transport that wraps the real one. For every chat completion it

* forces the benchmark's request fields (greedy ``temperature`` 0, ``ignore_eos``, optional fixed
  ``max_tokens``) so every system produces exactly the same number of output tokens per call;
* times the request (client-side latency, which includes queueing in the server);
* reads the response's ``usage`` and a hash of the generated text.

Sitting below the SDK means the benchmark needs no hook in ``tc.LLM`` beyond its ``http_client``
argument, and it measures what an application really waits for. Calls are keyed by
``run_id/node/n`` (n = the n-th request of that agent session) taken from the request's
``kv_transfer_params.tokencake`` metadata: the same key in two systems is the same piece of work.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from tokencake.events import META_KEY


@dataclass
class CallRecord:
    """One chat completion as the application saw it."""

    key: str
    run_id: str
    node: str
    session_id: str
    started: float
    finished: float
    status: int
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    text_sha1: str | None = None
    error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.finished - self.started

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["latency_s"] = round(self.latency_s, 6)
        return data


def _session_of(body: Mapping[str, Any]) -> tuple[str, str, str]:
    params = body.get("kv_transfer_params")
    meta = params.get(META_KEY) if isinstance(params, Mapping) else None
    if isinstance(meta, Mapping):
        run_id = str(meta.get("run_id", "?"))
        node = str(meta.get("node", "?"))
        return run_id, node, str(meta.get("session_id", f"{run_id}:{node}"))
    return "?", "?", "?"


def _parse_usage(record: CallRecord, payload: Any) -> None:
    if not isinstance(payload, Mapping):
        return
    usage = payload.get("usage")
    if isinstance(usage, Mapping):
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        if isinstance(details, Mapping):
            record.cached_tokens = details.get("cached_tokens")
    choices = payload.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        choice = choices[0]
        record.finish_reason = choice.get("finish_reason")
        message = choice.get("message")
        if isinstance(message, Mapping):
            content = message.get("content") or ""
            tool_calls = message.get("tool_calls") or []
            blob = json.dumps([content, tool_calls], sort_keys=True, default=str)
            record.text_sha1 = hashlib.sha1(blob.encode()).hexdigest()[:16]


class CallRecorder(httpx.AsyncBaseTransport):
    """Transport that forces request fields and records every chat completion (module docstring)."""

    def __init__(
        self,
        inner: httpx.AsyncBaseTransport | None = None,
        *,
        overrides: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
        on_record: Callable[[CallRecord], None] | None = None,
    ) -> None:
        self._inner = inner or httpx.AsyncHTTPTransport()
        self._overrides = dict(overrides or {})
        self._clock = clock
        self._on_record = on_record
        self._per_session: dict[str, int] = {}
        self.records: list[CallRecord] = []

    def _rewrite(self, request: httpx.Request) -> tuple[httpx.Request, dict[str, Any] | None]:
        if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
            return request, None
        try:
            body = json.loads(request.content or b"{}")
        except (ValueError, httpx.RequestNotRead):
            return request, None
        if not isinstance(body, dict):
            return request, None
        body.update(self._overrides)
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
        new = httpx.Request(
            request.method,
            request.url,
            headers=headers,
            content=json.dumps(body).encode(),
            extensions=request.extensions,
        )
        return new, body

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request, body = self._rewrite(request)
        if body is None:
            return await self._inner.handle_async_request(request)
        run_id, node, session = _session_of(body)
        n = self._per_session.get(session, 0)
        self._per_session[session] = n + 1
        record = CallRecord(
            key=f"{run_id}/{node}/{n}",
            run_id=run_id,
            node=node,
            session_id=session,
            started=self._clock(),
            finished=0.0,
            status=0,
        )
        try:
            response = await self._inner.handle_async_request(request)
            content = await response.aread()
        except BaseException as exc:
            record.finished = self._clock()
            record.error = f"{type(exc).__name__}: {exc}"[:500]
            self._add(record)
            raise
        record.finished = self._clock()
        record.status = response.status_code
        try:
            _parse_usage(record, json.loads(content))
        except ValueError:
            record.error = "response is not JSON"
        if response.status_code >= 400:
            record.error = content[:500].decode(errors="replace")
        self._add(record)
        headers = [
            (k, v)
            for k, v in response.headers.raw
            if k.lower() not in (b"content-length", b"content-encoding", b"transfer-encoding")
        ]
        return httpx.Response(
            response.status_code,
            headers=headers,
            content=content,
            request=request,
            extensions={k: v for k, v in response.extensions.items() if k != "network_stream"},
        )

    def _add(self, record: CallRecord) -> None:
        self.records.append(record)
        if self._on_record is not None:
            self._on_record(record)

    async def aclose(self) -> None:
        await self._inner.aclose()
