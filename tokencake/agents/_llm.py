"""The LLM client: ``openai.AsyncOpenAI`` over ``httpx.AsyncClient`` plus TokenCake request metadata.

Every request carries ``kv_transfer_params.tokencake`` (:class:`~tokencake.events.RequestMeta`) and a
vLLM ``priority`` through the client's ``extra_body``: stock servers ignore them, the TokenCake
extension uses them to keep each agent's KV cache across its turns.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import httpx
import openai

from tokencake.events import EVENTS_PORT_OFFSET, SESSION_HEADER, RequestMeta

from ._errors import LLMConnectionError
from ._events_probe import is_derived_local, missing_listener
from ._http import pool_limits
from ._loop import LoopLocal
from ._metadata import merge_metadata, metadata_fields
from ._retry import Retry, as_retry
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
    the variable, a loopback base URL gets ``"auto"`` (the local ``tokencake serve`` layout), any
    other host gets no reporting. That loopback port + 1 is checked before the first run: when no
    events listener answers there (a router in front of replicas, a server without the extension),
    one warning says so and the requests say ``stall_events: false`` (``_events_probe``).
    ``extra_body`` fields go into every request (a call's own ``extra_body`` wins), e.g.
    ``{"ignore_eos": True}`` for equal-work benchmarks.
    ``max_retries`` are the HTTP retries of the openai client (tool retries are separate).
    ``retry`` (a :class:`Retry` or a number of retries) replaces them for ``ctx.llm`` calls with
    TokenCake's own policy: exponential backoff with jitter, ``retry_on`` exception types, and an
    ``llm_failed`` run event per failed attempt.
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
        retry: Retry | int | None = None,
    ) -> None:
        self.extra_body: dict[str, Any] = dict(extra_body or {})
        self.retry = as_retry(retry, what="LLM(retry=)")
        #: False once the server rejected ``response_format`` (structured output then relies on
        #: instructions and validation only).
        self.supports_response_format = True
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
        return events_url_for(self.base_url, events_url)

    def _make_http_client(self) -> httpx.AsyncClient:
        """The httpx client under the openai client (ScriptedLLM swaps in a MockTransport)."""
        return httpx.AsyncClient(timeout=self.timeout, limits=pool_limits())

    def _make_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.base_url,
            api_key=self.api_key or "EMPTY",
            timeout=self.timeout,
            max_retries=0 if self.retry is not None else self.max_retries,
            http_client=self._http_client or self._make_http_client(),
        )

    @property
    def client(self) -> openai.AsyncOpenAI:
        """The openai client of the running event loop."""
        return self._clients.get()

    async def events_reachable(self) -> bool:
        """Whether this LLM's own stall events reach an events listener: False without an events
        URL; for the loopback port + 1 it derived, whether a listener answers there (checked at
        most once a minute); an events URL named elsewhere is taken as given."""
        url = self.events_url
        if url is None:
            return False
        if not is_derived_local(url, events_url_for(self.base_url, True)):
            return True
        return await missing_listener(url) is None

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
                try:
                    page = await self.client.models.list()
                except openai.APIConnectionError as exc:
                    raise LLMConnectionError(self.base_url, exc) from exc
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
        response_format: Mapping[str, Any] | None = None,
        max_retries: int | None = None,
    ) -> LLMReply:
        """One chat completion (non-streaming), with ``meta`` and its priority in the body.

        ``max_retries`` overrides the openai client's HTTP retries for this request. An unreachable
        server raises :class:`LLMConnectionError` naming the URL.
        """
        kwargs = await self._kwargs(
            messages, meta, max_tokens, temperature, tools, tool_choice, stop, extra_body, response_format
        )
        started = time.perf_counter()
        try:
            completion = await self._client(max_retries).chat.completions.create(**kwargs)
        except openai.APIConnectionError as exc:
            raise LLMConnectionError(self.base_url, exc) from exc
        latency = time.perf_counter() - started
        return _reply(completion, latency)

    async def chat_stream(
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
        response_format: Mapping[str, Any] | None = None,
        max_retries: int | None = None,
    ) -> AsyncIterator[str | LLMReply]:
        """One streamed chat completion: yields the text deltas, then the whole :class:`LLMReply`.

        Tool calls arrive in pieces and are assembled; usage comes from the server's final chunk
        (``stream_options.include_usage``).
        """
        kwargs = await self._kwargs(
            messages, meta, max_tokens, temperature, tools, tool_choice, stop, extra_body, response_format
        )
        kwargs.update(stream=True, stream_options={"include_usage": True})
        started = time.perf_counter()
        try:
            stream = await self._client(max_retries).chat.completions.create(**kwargs)
        except openai.APIConnectionError as exc:
            raise LLMConnectionError(self.base_url, exc) from exc
        parts: list[str] = []
        calls: dict[int, dict[str, str]] = {}
        finish: str | None = None
        usage = Usage()
        model = ""
        try:
            async for chunk in stream:
                model = chunk.model or model
                if chunk.usage is not None:
                    usage = Usage(
                        chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens
                    )
                for choice in chunk.choices[:1]:
                    delta = choice.delta
                    for part in delta.tool_calls or []:
                        acc = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                        acc["id"] = acc["id"] or (part.id or "")
                        if part.function is not None:
                            acc["name"] = acc["name"] or (part.function.name or "")
                            acc["arguments"] += part.function.arguments or ""
                    finish = choice.finish_reason or finish
                    if delta.content:
                        parts.append(delta.content)
                        yield delta.content
        except openai.APIConnectionError as exc:
            raise LLMConnectionError(self.base_url, exc) from exc
        finally:
            await stream.close()
        tool_calls = [_tool_call(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]
        yield LLMReply(
            text="".join(parts),
            tool_calls=[c for c in tool_calls if c is not None],
            usage=usage,
            finish_reason=finish,
            model=model,
            latency_s=time.perf_counter() - started,
        )

    def _client(self, max_retries: int | None) -> openai.AsyncOpenAI:
        client = self.client
        return client if max_retries is None else client.with_options(max_retries=max_retries)

    async def _kwargs(
        self,
        messages: Sequence[Mapping[str, Any]],
        meta: RequestMeta | None,
        max_tokens: int | None,
        temperature: float | None,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: str | None,
        stop: str | list[str] | None,
        extra_body: Mapping[str, Any] | None,
        response_format: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
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
        if response_format is not None:
            kwargs["response_format"] = dict(response_format)
        if meta is not None:
            if self.events_url is None and meta.stall_events and "stall_events" not in meta.model_fields_set:
                # Nobody said whether events are sent; this LLM sends none: the server derives stalls.
                meta = meta.model_copy(update={"stall_events": False})
            # A router in front of replicas keeps the session where its KV is (docs/scale-out.md).
            kwargs["extra_headers"] = {SESSION_HEADER: meta.session_id}
        kwargs["extra_body"] = request_extra_body(meta, {**self.extra_body, **(extra_body or {})})
        return kwargs

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
    if meta is None:
        return dict(extra_body or {})
    return merge_metadata(extra_body, metadata_fields(meta))


def events_url_for(base_url: str, events_url: str | bool | None) -> str | None:
    """Where stall events go for a server at ``base_url`` (see :class:`LLM` for the rules)."""
    if events_url is None:
        events_url = os.environ.get("TOKENCAKE_EVENTS_URL") or None
    if events_url is None and urlsplit(base_url).hostname in _LOOPBACK:
        events_url = "auto"
    if events_url is None or events_url is False or events_url == "":
        return None
    if events_url is True or events_url == "auto":
        parts = urlsplit(base_url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return urlunsplit((parts.scheme or "http", f"{host}:{port + EVENTS_PORT_OFFSET}", "", "", ""))
    return str(events_url).rstrip("/")


def _tool_call(call_id: str, name: str, arguments: str | None) -> ToolCall | None:
    if not name:
        return None
    try:
        args = json.loads(arguments or "{}")
        raw = None if isinstance(args, dict) else arguments
    except json.JSONDecodeError:
        args, raw = {}, arguments
    return ToolCall(call_id, name, args if isinstance(args, dict) else {}, raw)


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
        parsed = _tool_call(call.id, function.name, function.arguments)
        if parsed is not None:
            calls.append(parsed)
    usage = completion.usage
    return LLMReply(
        text=message.content or "",
        tool_calls=calls,
        usage=Usage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) if usage else Usage(),
        finish_reason=choice.finish_reason,
        model=completion.model or "",
        latency_s=latency,
    )
