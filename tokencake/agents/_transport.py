"""``TokenCakeTransport``: stamp every chat completion request with its session's TokenCake fields.

Agent frameworks build their own requests, but nearly all of them accept an ``httpx`` client.
Wrapping its transport is the one place where every request of a conversation passes, so the
framework code stays untouched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from types import TracebackType
from typing import Any

import httpx
import openai

from tokencake.events import SESSION_HEADER

from ._http import pool_limits
from ._llm import DEFAULT_BASE_URL
from ._metadata import merge_metadata
from ._session import Session

SessionSource = Session | Callable[[], Session | None]


class TokenCakeTransport(httpx.AsyncBaseTransport, httpx.BaseTransport):
    """An httpx transport (sync and async) that adds ``session``'s metadata to chat completions.

    Every ``POST …/chat/completions`` with a JSON body gets ``kv_transfer_params.tokencake`` and
    ``priority`` (keys the body already has are kept) and advances the session's turn; other
    requests pass through. ``session`` is a :class:`Session` or a function returning the current
    one (or None to send a request unchanged), for frameworks where one client serves many
    conversations. ``transport`` is the transport to wrap (default: httpx's HTTP transport).
    """

    def __init__(
        self,
        session: SessionSource,
        transport: httpx.AsyncBaseTransport | httpx.BaseTransport | None = None,
    ) -> None:
        if not (isinstance(session, Session) or callable(session)):
            raise TypeError(f"session must be a tc.Session or a function returning one, got {session!r}")
        self._session = session
        self._async = transport if isinstance(transport, httpx.AsyncBaseTransport) else None
        self._sync = transport if isinstance(transport, httpx.BaseTransport) else None
        self._own = transport is None

    def current_session(self) -> Session | None:
        return self._session if isinstance(self._session, Session) else self._session()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._async is None:
            if not self._own:
                raise TypeError("TokenCakeTransport wraps a sync transport; use it with httpx.Client")
            self._async = httpx.AsyncHTTPTransport(limits=pool_limits())
        if _is_chat(request):
            await request.aread()
        return await self._async.handle_async_request(self._stamp(request))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self._sync is None:
            if not self._own:
                raise TypeError("TokenCakeTransport wraps an async transport; use it with httpx.AsyncClient")
            self._sync = httpx.HTTPTransport(limits=pool_limits())
        if _is_chat(request):
            request.read()
        return self._sync.handle_request(self._stamp(request))

    def _stamp(self, request: httpx.Request) -> httpx.Request:
        if not _is_chat(request):
            return request
        session = self.current_session()
        if session is None:
            return request
        try:
            body = json.loads(request.content)
        except ValueError:
            return request
        if not isinstance(body, dict):
            return request
        content = json.dumps(merge_metadata(body, session.request_metadata())).encode()
        headers = httpx.Headers(request.headers)
        headers.pop("content-length", None)
        headers.pop("transfer-encoding", None)
        headers.setdefault(SESSION_HEADER, session.session_id)  # for a router's session affinity
        return httpx.Request(
            request.method, request.url, headers=headers, content=content, extensions=request.extensions
        )

    async def aclose(self) -> None:
        if self._async is not None:
            await self._async.aclose()

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()

    async def __aenter__(self) -> TokenCakeTransport:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        await self.aclose()

    def __enter__(self) -> TokenCakeTransport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        self.close()


def openai_client(
    session: SessionSource,
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    timeout: float = 300.0,
    transport: httpx.AsyncBaseTransport | None = None,
    **kwargs: Any,
) -> openai.AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` whose chat completions carry ``session``'s TokenCake metadata.

    ``base_url`` / ``api_key`` default to the session's (when ``session`` is a :class:`Session`),
    else ``TOKENCAKE_BASE_URL`` (``http://127.0.0.1:8000/v1``) and ``TOKENCAKE_API_KEY``; other
    keywords go to ``AsyncOpenAI``.
    """
    http_client = httpx.AsyncClient(transport=TokenCakeTransport(session, transport), timeout=timeout)
    own = session if isinstance(session, Session) else None
    own_url = own.base_url if own is not None else None
    own_key = own.api_key if own is not None else None
    return openai.AsyncOpenAI(
        base_url=base_url or own_url or os.environ.get("TOKENCAKE_BASE_URL") or DEFAULT_BASE_URL,
        api_key=api_key or own_key or os.environ.get("TOKENCAKE_API_KEY") or "EMPTY",
        timeout=timeout,
        http_client=http_client,
        **kwargs,
    )


def _is_chat(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.rstrip("/").endswith("/chat/completions")
