"""``tc.testing``: test agents built on any framework offline, against a scripted OpenAI server.

:class:`ScriptedTransport` is an OpenAI-compatible server inside an httpx transport (sync and
async): give it to whatever client the framework uses (``ScriptedTransport.openai_client``,
``httpx.AsyncClient(transport=...)``), and the framework's real request code runs against replies
from a script -- text, tool calls, several parallel tool calls, streamed (server-sent events) when
the client asks. It can also answer as a TokenCake server does, with the KV provenance of each
request (``kv=``, :func:`kv_provenance`). Stall events are recorded with ``tc.StallRecorder`` (a
session's ``hooks=``), and :func:`closed_pairs` checks them. ``docs/integrations.md`` has one
example per framework adapter.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import httpx
import openai

from .agents import ScriptedLLM, ScriptedRequest, Session, StallRecorder, openai_client
from .agents._scripted import Script
from .events import StallBegin, StallEnd

__all__ = ["BASE_URL", "ScriptedTransport", "StallRecorder", "closed_pairs", "kv_provenance"]

#: The base URL the scripted server answers on (any host works; this one never resolves).
BASE_URL = "http://tokencake.test/v1"

#: The ``tokencake_kv`` a scripted response carries: one for every request, or per request.
KvScript = Mapping[str, int] | Callable[[ScriptedRequest], Mapping[str, int] | None] | None


class ScriptedTransport(httpx.AsyncBaseTransport, httpx.BaseTransport):
    """An offline OpenAI-compatible server: chat completions answered from a script.

    ``replies`` is a ``tc.ScriptedLLM`` script (a string, a list of replies consumed in order, a
    function of the :class:`tc.ScriptedRequest`, or a dict per ``node``; a reply is text, a
    ``tc.ToolCall`` or a list of them for parallel calls) or a ``tc.ScriptedLLM``. ``requests``
    holds every chat completion body as received (the TokenCake metadata included). ``kv`` makes
    non-streamed responses carry ``kv_transfer_params.tokencake_kv``, as a TokenCake server's do:
    a dict for every response, or a function of the request returning one (or None). Also serves
    ``GET /v1/models``.
    """

    def __init__(
        self,
        replies: Script | ScriptedLLM,
        *,
        kv: KvScript = None,
        token_delay: float = 0.0,
        model: str = "scripted",
    ) -> None:
        self.llm = (
            replies
            if isinstance(replies, ScriptedLLM)
            else ScriptedLLM(replies, token_delay=token_delay, model=model)
        )
        self.kv = kv
        self.base_url = BASE_URL

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every chat completion request body, in arrival order."""
        return self.llm.requests

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        index = len(self.requests)  # the handler records the body before its first await
        response = await self.llm._handle(request)
        return self._with_kv(response, index)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()

        async def answer() -> httpx.Response:
            index = len(self.requests)
            response = await self.llm._handle(request)
            await response.aread()  # a streamed reply, whole: sync clients read bytes
            whole = httpx.Response(response.status_code, headers=response.headers, content=response.content)
            return self._with_kv(whole, index)

        return _run(answer)

    def _with_kv(self, response: httpx.Response, index: int) -> httpx.Response:
        if self.kv is None or response.status_code != 200 or index >= len(self.requests):
            return response
        if "json" not in response.headers.get("content-type", ""):
            return response  # streamed: a server sends no kv_transfer_params in chunks
        body = json.loads(response.content)
        if body.get("object") != "chat.completion":
            return response
        kv = self.kv(ScriptedRequest.of(self.requests[index], index)) if callable(self.kv) else self.kv
        if kv is None:
            return response
        body["kv_transfer_params"] = {"tokencake_kv": dict(kv)}
        return httpx.Response(response.status_code, json=body)

    def openai_client(
        self, session: Session | Callable[[], Session | None] | None = None
    ) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` on this server; with ``session``, ``tc.openai_client(session)``'s
        (every chat completion stamped with the session's metadata)."""
        if session is not None:
            return openai_client(session, base_url=self.base_url, api_key="test", transport=self)
        return openai.AsyncOpenAI(
            base_url=self.base_url, api_key="test", max_retries=0, http_client=self.http_async_client()
        )

    def http_async_client(self) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` on this server (``http_async_client=`` of LangChain models)."""
        return httpx.AsyncClient(transport=self)

    def http_client(self) -> httpx.Client:
        """An ``httpx.Client`` on this server (for sync clients, e.g. ``ChatOpenAI(http_client=...)``)."""
        return httpx.Client(transport=self)

    def __repr__(self) -> str:
        return f"ScriptedTransport({self.base_url!r}, requests={len(self.requests)})"


def kv_provenance(
    prompt_tokens: int,
    *,
    kept_tokens: int = 0,
    prefetched_tokens: int = 0,
    loaded_tokens: int = 0,
    admissions: int = 1,
    failed_copy_tokens: int = 0,
    failed_load_tokens: int = 0,
) -> dict[str, int]:
    """A TokenCake server's ``tokencake_kv`` for one request, for ``ScriptedTransport(kv=...)``.

    Of the ``prompt_tokens``, ``kept_tokens`` found their KV still on the GPU, ``prefetched_tokens``
    on the GPU where a prefetch put it back, ``loaded_tokens`` loaded from host memory when the
    request arrived; the rest were computed.
    """
    return {
        "device_tokens": kept_tokens + prefetched_tokens,
        "prefetched_tokens": prefetched_tokens,
        "copied_tokens": prefetched_tokens,
        "host_tokens": loaded_tokens,
        "prompt_tokens": prompt_tokens,
        "admissions": admissions,
        "failed_copy_tokens": failed_copy_tokens,
        "failed_load_tokens": failed_load_tokens,
    }


def closed_pairs(recorder: StallRecorder) -> list[tuple[StallBegin, StallEnd]]:
    """The recorded stalls as (begin, end) pairs, checked: each begin has exactly one end with its
    ids and tool, and nothing else was recorded. Raises ``AssertionError`` naming the first problem."""
    pairs = recorder.pairs()
    for begin, end in pairs:
        if end is None:
            raise AssertionError(f"stall {begin.stall_id} ({begin.tool}) has no stall_end")
        if (end.session_id, end.tool) != (begin.session_id, begin.tool):
            raise AssertionError(f"stall {begin.stall_id}: its end names {end.session_id}/{end.tool}")
    if len({begin.stall_id for begin, _ in pairs}) != len(pairs):
        raise AssertionError("two stall_begin events share one stall_id")
    if len(recorder.events) != 2 * len(pairs):
        raise AssertionError(
            f"{len(recorder.events)} events for {len(pairs)} stalls (one begin and one end each)"
        )
    return [(begin, end) for begin, end in pairs if end is not None]


def _run(fn: Callable[[], Coroutine[Any, Any, httpx.Response]]) -> httpx.Response:
    """``fn()`` run to completion from sync code, also from a thread whose event loop is running."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(fn())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, fn()).result()
