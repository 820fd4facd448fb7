"""The LLM client: ``openai.AsyncOpenAI`` over ``httpx.AsyncClient`` plus TokenCake request metadata.

Every request carries ``kv_transfer_params.tokencake`` (:class:`~tokencake.events.RequestMeta`) and a
vLLM ``priority`` through the client's ``extra_body``: stock servers ignore them, the TokenCake
extension uses them to keep each agent's KV cache across its turns.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import httpx
import openai

from tokencake.events import EVENTS_PORT_OFFSET, META_KEY, RequestMeta, priority_from_graph

from ._loop import LoopLocal
from ._stall import HttpStallReporter

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True)
class Usage:
    """Token counts; instances add up (``a + b``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.total_tokens + other.total_tokens,
        )


@dataclass(frozen=True)
class ToolCall:
    """A tool call requested by the model (or scripted for :class:`ScriptedLLM`).

    ``raw_arguments`` keeps the JSON text when it did not parse (``arguments`` is then empty).
    """

    id: str = ""
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    raw_arguments: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ToolCall needs a name")

    def to_message(self) -> dict[str, Any]:
        """The ``tool_calls`` entry of an assistant message."""
        text = self.raw_arguments if self.raw_arguments is not None else json.dumps(self.arguments)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": text}}


@dataclass
class LLMReply:
    """What ``ctx.llm`` returns. ``usage`` and ``turns`` cover the whole tool loop of the call."""

    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None
    model: str = ""
    turns: int = 1
    latency_s: float = 0.0

    def message(self) -> dict[str, Any]:
        """This reply as an assistant message for the conversation."""
        content = self.text if self.text or not self.tool_calls else None
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.tool_calls:
            msg["tool_calls"] = [tc.to_message() for tc in self.tool_calls]
        return msg

    def __str__(self) -> str:
        return self.text


class LLM:
    """An OpenAI-compatible chat endpoint (vLLM with the TokenCake extension, or any other).

    Arguments default to the environment: ``TOKENCAKE_BASE_URL`` (default
    ``http://127.0.0.1:8000/v1``), ``TOKENCAKE_MODEL`` (default: the first model the server lists),
    ``TOKENCAKE_API_KEY`` and ``TOKENCAKE_EVENTS_URL``. ``events_url="auto"`` derives the events
    listener from the base URL (port + 1); ``False`` disables stall reporting. Without an argument or
    the variable, a loopback base URL gets ``"auto"`` (the local ``tokencake serve`` layout; a server
    without the extension costs one warning), any other host gets no reporting.
    ``extra_body`` fields go into every request (a call's own ``extra_body`` wins), e.g.
    ``{"ignore_eos": True}`` for equal-work benchmarks.
    ``max_retries`` are the HTTP retries of the openai client (tool retries are separate).
    """

    def __init__(
        self,
        base_url: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        *,
        events_url: str | bool | None = None,
        timeout: float = 300.0,
        max_retries: int = 2,
        http_client: httpx.AsyncClient | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        self.extra_body: dict[str, Any] = dict(extra_body or {})
        self.base_url = (base_url or os.environ.get("TOKENCAKE_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self.model = model or os.environ.get("TOKENCAKE_MODEL") or None
        self.api_key = api_key or os.environ.get("TOKENCAKE_API_KEY") or None
        self.timeout = timeout
        self.max_retries = max_retries
        self.events_url = self._events_url(events_url)
        self._http_client = http_client
        self._clients: LoopLocal[openai.AsyncOpenAI] = LoopLocal(self._make_client)
        self._reporter: HttpStallReporter | None = None
        self._model_lock: LoopLocal[anyio.Lock] = LoopLocal(anyio.Lock)

    def _events_url(self, events_url: str | bool | None) -> str | None:
        if events_url is None:
            events_url = os.environ.get("TOKENCAKE_EVENTS_URL") or None
        if events_url is None and urlsplit(self.base_url).hostname in _LOOPBACK:
            events_url = "auto"
        if events_url is None or events_url is False or events_url == "":
            return None
        if events_url is True or events_url == "auto":
            parts = urlsplit(self.base_url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            host = parts.hostname or "127.0.0.1"
            host = f"[{host}]" if ":" in host else host
            return urlunsplit((parts.scheme or "http", f"{host}:{port + EVENTS_PORT_OFFSET}", "", "", ""))
        return str(events_url).rstrip("/")

    def _make_http_client(self) -> httpx.AsyncClient:
        """The httpx client under the openai client (ScriptedLLM swaps in a MockTransport)."""
        return httpx.AsyncClient(timeout=self.timeout)

    def _make_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.base_url,
            api_key=self.api_key or "EMPTY",
            timeout=self.timeout,
            max_retries=self.max_retries,
            http_client=self._http_client or self._make_http_client(),
        )

    @property
    def client(self) -> openai.AsyncOpenAI:
        """The openai client of the running event loop."""
        return self._clients.get()

    def stall_reporter(self) -> HttpStallReporter | None:
        """The reporter to this server's events listener (one per LLM), or None without events_url."""
        if self.events_url is None:
            return None
        if self._reporter is None:
            self._reporter = HttpStallReporter(self.events_url, api_key=self.api_key)
        return self._reporter

    async def resolve_model(self) -> str:
        """``model``, or the first model ``GET /v1/models`` lists (looked up once)."""
        if self.model:
            return self.model
        async with self._model_lock.get():
            if not self.model:
                page = await self.client.models.list()
                ids = [m.id for m in page.data]
                if not ids:
                    raise RuntimeError(f"the server at {self.base_url} lists no models; pass model=")
                self.model = ids[0]
        return self.model

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        meta: RequestMeta | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | None = None,
        stop: str | list[str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> LLMReply:
        """One chat completion (non-streaming), with ``meta`` and its priority in the body."""
        model = await self.resolve_model()
        kwargs: dict[str, Any] = {"model": model, "messages": list(messages)}
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        if temperature is not None:
            kwargs["temperature"] = temperature
        if stop is not None:
            kwargs["stop"] = stop
        if tools:
            kwargs["tools"] = list(tools)
            if tool_choice is not None:
                kwargs["tool_choice"] = tool_choice
        kwargs["extra_body"] = request_extra_body(meta, {**self.extra_body, **(extra_body or {})})
        started = time.perf_counter()
        completion = await self.client.chat.completions.create(**kwargs)
        latency = time.perf_counter() - started
        return _reply(completion, latency)

    async def aclose(self) -> None:
        client = self._clients.current()
        if client is not None and self._http_client is None:
            await client.close()
        self._clients.clear()
        if self._reporter is not None:
            await self._reporter.aclose()

    async def __aenter__(self) -> LLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r}, model={self.model!r})"


def request_extra_body(
    meta: RequestMeta | None, extra_body: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Merge the TokenCake fields into the caller's ``extra_body`` (caller's own keys are kept)."""
    body: dict[str, Any] = dict(extra_body or {})
    if meta is not None:
        kv = dict(body.get("kv_transfer_params") or {})
        kv.setdefault(META_KEY, meta.model_dump(mode="json"))
        body["kv_transfer_params"] = kv
        body.setdefault("priority", priority_from_graph(meta.graph, meta.importance))
    return body


def _reply(completion: Any, latency: float) -> LLMReply:
    if not completion.choices:
        raise RuntimeError("the server returned a completion without choices")
    choice = completion.choices[0]
    message = choice.message
    calls = []
    for call in message.tool_calls or []:
        function = getattr(call, "function", None)
        if function is None:  # custom (non-function) tool calls are not ours
            continue
        try:
            args = json.loads(function.arguments or "{}")
            raw = None if isinstance(args, dict) else function.arguments
        except json.JSONDecodeError:
            args, raw = {}, function.arguments
        calls.append(ToolCall(call.id, function.name, args if isinstance(args, dict) else {}, raw))
    usage = completion.usage
    return LLMReply(
        text=message.content or "",
        tool_calls=calls,
        usage=Usage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) if usage else Usage(),
        finish_reason=choice.finish_reason,
        model=completion.model or "",
        latency_s=latency,
    )
