"""An offline, deterministic model that speaks the OpenAI wire format.

:class:`ScriptedLLM` is a real :class:`LLM`: the openai client builds real HTTP requests, and an
``httpx.MockTransport`` answers them. Tests therefore exercise the same code path as production,
and can inspect the exact request bodies (``.requests``) a server would see.
"""

from __future__ import annotations

import itertools
import json
import re
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

from tokencake.events import META_KEY

from ._llm import LLM, ToolCall
from ._retry import Retry

Reply = str | ToolCall | list[ToolCall] | dict[str, Any]
ReplyFn = Callable[["ScriptedRequest"], Reply]
Script = str | ReplyFn | Sequence[Reply | ReplyFn] | Mapping[str, ReplyFn | Sequence[Reply | ReplyFn] | str]

_WORD = re.compile(r"\S+")


def count_tokens(text: str | None) -> int:
    """Deterministic token count: whitespace-separated words, long words count per 8 characters."""
    if not text:
        return 0
    return sum(max(1, -(-len(w) // 8)) for w in _WORD.findall(text))


@dataclass(frozen=True)
class ScriptedRequest:
    """One chat request as the scripted model sees it (read its fields to decide the reply).

    ``tools`` lists the names of the tools the request offers; ``body`` is the whole JSON body.
    """

    body: dict[str, Any]
    index: int  # 0-based number of this request on this ScriptedLLM
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, body: dict[str, Any], index: int) -> ScriptedRequest:
        """The request with JSON ``body``, the ``index``-th a scripted model received."""
        kv = body.get("kv_transfer_params") or {}
        return cls(
            body=body,
            index=index,
            messages=list(body.get("messages") or []),
            tools=[t.get("function", {}).get("name", "") for t in body.get("tools") or []],
            meta=dict(kv.get(META_KEY) or {}) if isinstance(kv, dict) else {},
        )

    @property
    def node(self) -> str:
        return str(self.meta.get("node", ""))

    @property
    def session_id(self) -> str:
        return str(self.meta.get("session_id", ""))

    @property
    def turn(self) -> int:
        return int(self.meta.get("turn", 0))

    @property
    def stream(self) -> bool:
        """True when the client asked for a streamed (SSE) reply."""
        return bool(self.body.get("stream"))

    @property
    def response_format(self) -> dict[str, Any] | None:
        """The request's ``response_format`` (e.g. a ``json_schema`` for structured output)."""
        value = self.body.get("response_format")
        return value if isinstance(value, dict) else None

    @property
    def prompt(self) -> str:
        """Text of the last user message."""
        for msg in reversed(self.messages):
            if msg.get("role") == "user":
                return _content_text(msg.get("content"))
        return ""

    @property
    def tool_results(self) -> list[str]:
        """Contents of the tool messages after the last assistant message (answers to its calls)."""
        out: list[str] = []
        for msg in reversed(self.messages):
            if msg.get("role") == "tool":
                out.append(_content_text(msg.get("content")))
            else:
                break
        return out[::-1]


class ScriptedLLM(LLM):
    """Replies from a script instead of a model.

    ``replies`` is one of: a string (always that text); a function ``f(ScriptedRequest)`` returning a
    reply; a list of replies (or such functions) consumed in order; or a dict
    ``{node: list | function | str}`` with an optional ``"*"`` fallback. A reply is a string, a
    :class:`ToolCall`, a list of them, or a dict ``{"content": ..., "tool_calls": [...],
    "finish_reason": ...}``. ``token_delay`` seconds are slept per completion token (simulated
    decoding). Streamed requests (``stream=True``) get
    server-sent events, one chunk per word, tool-call arguments in two pieces, and a final usage
    chunk when ``stream_options.include_usage`` asks for it.
    """

    def __init__(
        self,
        replies: Script,
        *,
        token_delay: float = 0.0,
        model: str = "scripted",
        events_url: str | bool | None = False,
        base_url: str = "http://scripted.tokencake.invalid/v1",
        retry: Retry | int | None = None,
    ) -> None:
        self.requests: list[dict[str, Any]] = []
        self.token_delay = token_delay
        self.served_model = model
        self._script = _compile(replies)
        self._ids = itertools.count(1)
        super().__init__(base_url, None, "scripted", events_url=events_url, max_retries=0, retry=retry)

    def _make_http_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self._handle), timeout=self.timeout)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and path.endswith("/models"):
            model = {"id": self.served_model, "object": "model", "created": 0, "owned_by": "tokencake"}
            return httpx.Response(200, json={"object": "list", "data": [model]})
        if request.method == "POST" and path.endswith("/chat/completions"):
            try:
                body = json.loads(request.content)
            except json.JSONDecodeError:
                return _error(400, "request body is not JSON")
            return await self._complete(body)
        return _error(404, f"ScriptedLLM does not serve {request.method} {path}")

    async def _complete(self, body: dict[str, Any]) -> httpx.Response:
        self.requests.append(body)
        req = ScriptedRequest.of(body, len(self.requests) - 1)
        try:
            reply = self._script(req)
        except _ScriptExhausted as exc:
            return _error(400, str(exc))
        message, finish = self._message(reply)
        completion_tokens = count_tokens(message.get("content")) + sum(
            count_tokens(c["function"]["arguments"]) + 1 for c in message.get("tool_calls", [])
        )
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if max_tokens and completion_tokens > max_tokens and not message.get("tool_calls"):
            words = _WORD.findall(message.get("content") or "")
            message["content"] = " ".join(words[: int(max_tokens)])
            completion_tokens, finish = count_tokens(message["content"]), "length"
        completion_tokens = max(1, completion_tokens)
        prompt_tokens = sum(_message_tokens(m) for m in req.messages)
        completion_id = f"chatcmpl-scripted-{next(self._ids)}"
        model = body.get("model") or self.served_model
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if req.stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = self._sse(completion_id, model, message, finish, usage if include_usage else None)
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events)
        if self.token_delay > 0:
            await anyio.sleep(self.token_delay * completion_tokens)
        return httpx.Response(
            200,
            json={
                "id": completion_id,
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": usage,
            },
        )

    async def _sse(
        self,
        completion_id: str,
        model: str,
        message: dict[str, Any],
        finish: str,
        usage: dict[str, int] | None,
    ) -> AsyncIterator[bytes]:
        """The completion as ``chat.completion.chunk`` server-sent events."""

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            chunk = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": 0,
                "model": model,
                "choices": choices,
                **extra,
            }
            return f"data: {json.dumps(chunk)}\n\n".encode()

        def delta(body: dict[str, Any], finish_reason: str | None = None) -> bytes:
            return event([{"index": 0, "delta": body, "finish_reason": finish_reason, "logprobs": None}])

        yield delta({"role": "assistant", "content": ""})
        for piece in re.split(r"(?<=\s)(?=\S)", message.get("content") or ""):
            if piece:
                if self.token_delay > 0:
                    await anyio.sleep(self.token_delay * max(1, count_tokens(piece)))
                yield delta({"content": piece})
        for index, call in enumerate(message.get("tool_calls", [])):
            args = call["function"]["arguments"]
            half = len(args) // 2
            head = {"name": call["function"]["name"], "arguments": args[:half]}
            yield delta(
                {"tool_calls": [{"index": index, "id": call["id"], "type": "function", "function": head}]}
            )
            if self.token_delay > 0:
                await anyio.sleep(self.token_delay * max(1, count_tokens(args)))
            yield delta({"tool_calls": [{"index": index, "function": {"arguments": args[half:]}}]})
        yield delta({}, finish)
        if usage is not None:
            yield event([], usage=usage)
        yield b"data: [DONE]\n\n"

    def _message(self, reply: Reply) -> tuple[dict[str, Any], str]:
        finish = None
        if isinstance(reply, dict):
            content = reply.get("content")
            calls = reply.get("tool_calls") or []
            finish = reply.get("finish_reason")
        elif isinstance(reply, ToolCall):
            content, calls = None, [reply]
        elif isinstance(reply, list):
            content, calls = None, reply
        elif isinstance(reply, str):
            content, calls = reply, []
        else:
            kind = type(reply).__name__
            raise TypeError(f"ScriptedLLM reply must be str, ToolCall, list or dict, got {kind}")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [self._call(c) for c in calls]
        return message, finish or ("tool_calls" if calls else "stop")

    def _call(self, call: ToolCall | Mapping[str, Any]) -> dict[str, Any]:
        if isinstance(call, Mapping):
            call = ToolCall(str(call.get("id", "")), str(call["name"]), dict(call.get("arguments") or {}))
        entry = call.to_message()
        entry["id"] = call.id or f"call_{next(self._ids)}"
        return entry


class _ScriptExhausted(LookupError):
    pass


def _compile(replies: Script) -> ReplyFn:
    if isinstance(replies, str):
        text = replies
        return lambda _req: text
    if callable(replies):
        return replies
    if isinstance(replies, Mapping):
        per_node = {str(k): _compile_one(v, f"node {k!r}") for k, v in replies.items()}

        def by_node(req: ScriptedRequest) -> Reply:
            fn = per_node.get(req.node) or per_node.get("*")
            if fn is None:
                raise _ScriptExhausted(f"ScriptedLLM has no script for node {req.node!r} (and no '*')")
            return fn(req)

        return by_node
    if isinstance(replies, Sequence):
        return _compile_one(replies, "the script")
    raise TypeError(f"ScriptedLLM replies must be str, callable, list or dict, got {type(replies).__name__}")


def _compile_one(entry: ReplyFn | Sequence[Reply | ReplyFn] | str, what: str) -> ReplyFn:
    if isinstance(entry, str) or callable(entry):
        return _compile(entry)
    queue: deque[Reply | ReplyFn] = deque(entry)

    def pop(req: ScriptedRequest) -> Reply:
        if not queue:
            raise _ScriptExhausted(f"ScriptedLLM: {what} has no reply left (request {req.index})")
        reply = queue.popleft()
        return reply(req) if callable(reply) else reply

    return pop


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _message_tokens(msg: Mapping[str, Any]) -> int:
    n = 4 + count_tokens(_content_text(msg.get("content")))
    for call in msg.get("tool_calls") or []:
        n += count_tokens(json.dumps(call.get("function", {})))
    return n


def _error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "invalid_request_error"}})
