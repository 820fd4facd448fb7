"""Transparent mode's ASGI plumbing (``transparent_asgi.py`` is the middleware): vLLM's API key
rule, the body rewrite that adds the request's metadata, and the replay of a body already read.

Nothing here knows about conversations; each piece keeps a request as stock vLLM would see it:

* :class:`ApiKeys` accepts exactly the requests vLLM's ``AuthenticationMiddleware`` accepts
  (``--api-key``, else ``VLLM_API_KEY``; a ``Bearer`` token whose sha256 digest equals a key's),
  so a request vLLM refuses never touches a conversation;
* :func:`with_meta` adds ``kv_transfer_params.tokencake``, keeping the client's bytes where it
  can (a UTF-8 body without the field: spliced in front), else re-dumping the document;
* :func:`replay` hands the app the messages already read, then the rest of the stream, and keeps
  none of them once handed on.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from tokencake.events import META_KEY, RequestMeta

__all__ = ["ApiKeys", "Message", "Receive", "Scope", "Send", "answer_json", "header", "replay",
           "request_path", "with_meta"]  # fmt: skip

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lower case), decoded as ASGI servers do (latin-1)."""
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def request_path(scope: Scope) -> str:
    """The request's path without ``root_path`` and a trailing slash."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", ""))
    if root and path.startswith(root):
        path = path[len(root) :]
    return path.rstrip("/")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    """vLLM's API key check (``vllm/entrypoints/serve/middleware/authenticate.py``): the keys are
    ``--api-key`` (the app's ``state.args``), else ``VLLM_API_KEY``, read on the first request;
    none: every request passes. Only the keys' sha256 digests are kept, compared in constant
    time (the token's length does not show either)."""

    def __init__(self, keys: Iterable[str] | None = None) -> None:
        self._digests = None if keys is None else [_digest(k) for k in keys if k]

    def allows(self, scope: Scope) -> bool:
        """Whether vLLM will accept the request's ``Authorization`` header."""
        if self._digests is None:
            args = getattr(getattr(scope.get("app"), "state", None), "args", None)
            keys = list(getattr(args, "api_key", None) or []) or [os.environ.get("VLLM_API_KEY") or ""]
            self._digests = [_digest(k) for k in keys if k]
        if not self._digests:
            return True
        scheme, _, token = (header(scope, b"authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = _digest(token)
        match = False
        for key in self._digests:
            match |= secrets.compare_digest(digest, key)
        return match


def with_meta(body: bytes, doc: dict[str, Any], meta: RequestMeta) -> bytes:
    """``body`` (parsed: ``doc``) with ``kv_transfer_params.tokencake`` added. The client's bytes
    are kept when it sent no ``kv_transfer_params`` and the body is UTF-8 (the field is spliced in
    front); a body in another encoding JSON allows (UTF-16 or UTF-32, a byte order mark), or one
    that has the field, is re-dumped as UTF-8."""
    fields = meta.model_dump(mode="json", exclude={"stall_events"})
    stripped = body.lstrip()
    if "kv_transfer_params" not in doc and stripped[:1] == b"{" and _is_utf8(body):
        head = b'{"kv_transfer_params":' + json.dumps({META_KEY: fields}).encode()
        return head + (b"," if doc else b"") + stripped[1:]
    kv = doc.get("kv_transfer_params") or {}
    return json.dumps({**doc, "kv_transfer_params": {**kv, META_KEY: fields}}).encode()


def _is_utf8(body: bytes) -> bool:
    """Whether ``body`` is JSON text in UTF-8 without a byte order mark. ``json.loads`` (which
    vLLM's request parsing uses) detects the encoding from the first bytes: UTF-16 and UTF-32
    show as NUL bytes there, and ASCII text in UTF-16 would pass a UTF-8 decode alone."""
    if json.detect_encoding(body) != "utf-8":
        return False
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


async def answer_json(send: Send, doc: Mapping[str, Any]) -> None:
    """Answer the request with ``doc`` as JSON (status 200)."""
    body = json.dumps(doc).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that returns ``messages`` first, taking each out of the list (the caller keeps
    no reference to a body once the app has read it), then reads on (disconnects included)."""

    async def replayed() -> Message:
        if messages:
            return messages.pop(0)
        return await receive()

    return replayed
