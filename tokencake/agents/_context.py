"""``Context``: what a node function uses to talk to the model and call tools.

One ``Context`` per node per run. It owns the node's conversation (so consecutive ``ctx.llm`` calls
continue one session whose KV the server can keep) and wraps every tool attempt in stall events.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import anyio
import openai
from pydantic import BaseModel

from tokencake.events import GraphMeta, NextStall, RequestMeta, StallBegin

from ._errors import OutputValidationError, ToolError, ToolTimeout
from ._llm import LLMReply, ToolCall, Usage
from ._llm_stream import LLMStream
from ._output import check_output_type, instructions, parse_output, response_format, retry_prompt
from ._result import jsonable
from ._retry import LLM_TRANSIENT_ERRORS, Retry, as_retry
from ._stall import StallScope
from ._tool import Tool

if TYPE_CHECKING:
    from ._node import Node, Ref
    from ._result import NodeResult
    from ._runner import RunState

Message = dict[str, Any]
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class _Call:
    """The options of one ``ctx.llm`` call."""

    system: str | None
    max_tokens: int | None
    temperature: float | None
    tools: Sequence[Ref] | None
    max_turns: int
    stop: str | list[str] | None
    extra_body: Mapping[str, Any] | None
    new_session: bool
    retry: Retry | None
    response_format: Mapping[str, Any] | None = None


class Context:
    """The handle a node function receives as ``ctx``.

    ``inputs`` are the run inputs (read-only); ``messages`` is the node's conversation so far.
    ``parent`` is the node that spawned this one with :meth:`fan_out` (None for DAG nodes).
    """

    def __init__(
        self,
        state: RunState,
        node: Node,
        result: NodeResult,
        *,
        name: str | None = None,
        parent: str | None = None,
        slot: Any = None,
    ) -> None:
        self._state = state
        self._slot = slot
        self._node = node
        self._result = result
        self.node = name or node.name
        self.parent = parent
        self.run_id = state.run_id
        self.inputs: Mapping[str, Any] = state.inputs
        self.agent_type = node.agent_type or node.name
        self.messages: list[Message] = []
        self._session_n = 0
        self._turn = 0
        self._next_call = 0  # index into node.calls of the next expected graph-fixed call

    @property
    def session_id(self) -> str:
        """``{run_id}:{node}`` (``#n`` appended after ``new_session=True``)."""
        base = f"{self.run_id}:{self.node}"
        return base if self._session_n == 0 else f"{base}#{self._session_n}"

    @property
    def meta(self) -> GraphMeta:
        return self._state.metas[self.node]

    @property
    def app(self) -> Any:
        return self._state.app

    # ------------------------------------------------------------------ LLM

    @overload
    def llm(
        self,
        prompt: str | Sequence[Message],
        *,
        system: str | None = ...,
        max_tokens: int | None = ...,
        temperature: float | None = ...,
        tools: Sequence[Ref] | None = ...,
        max_turns: int = ...,
        stop: str | list[str] | None = ...,
        extra_body: Mapping[str, Any] | None = ...,
        new_session: bool = ...,
        stream: Literal[False] = ...,
        output_type: None = ...,
        output_retries: int = ...,
        retry: Retry | int | None = ...,
    ) -> Awaitable[LLMReply]: ...
    @overload
    def llm(
        self,
        prompt: str | Sequence[Message],
        *,
        system: str | None = ...,
        max_tokens: int | None = ...,
        temperature: float | None = ...,
        tools: Sequence[Ref] | None = ...,
        max_turns: int = ...,
        stop: str | list[str] | None = ...,
        extra_body: Mapping[str, Any] | None = ...,
        new_session: bool = ...,
        stream: Literal[False] = ...,
        output_type: type[M],
        output_retries: int = ...,
        retry: Retry | int | None = ...,
    ) -> Awaitable[M]: ...
    @overload
    def llm(
        self,
        prompt: str | Sequence[Message],
        *,
        system: str | None = ...,
        max_tokens: int | None = ...,
        temperature: float | None = ...,
        tools: Sequence[Ref] | None = ...,
        max_turns: int = ...,
        stop: str | list[str] | None = ...,
        extra_body: Mapping[str, Any] | None = ...,
        new_session: bool = ...,
        stream: Literal[True],
        output_type: None = ...,
        output_retries: int = ...,
        retry: Retry | int | None = ...,
    ) -> LLMStream: ...

    def llm(
        self,
        prompt: str | Sequence[Message],
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        tools: Sequence[Ref] | None = None,
        max_turns: int = 8,
        stop: str | list[str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        new_session: bool = False,
        stream: bool = False,
        output_type: type[BaseModel] | None = None,
        output_retries: int = 2,
        retry: Retry | int | None = None,
    ) -> Awaitable[Any] | LLMStream:
        """Send ``prompt`` (text, or messages to append) in this node's conversation.

        ``system``, ``max_tokens``, ``temperature`` and ``extra_body`` default to the node's
        options (``extra_body``: the node's fields, then the call's). With tools
        (``tools=`` or the node's ``tools``) the model-driven loop runs: the tool calls of one
        turn are validated and executed concurrently (each its own stall) and their results sent
        back in the model's order, for at most ``max_turns`` requests; the last request forbids
        tools (``tool_choice="none"``). A :class:`ToolError` (bad arguments, timeout, or raised by
        the tool) goes back to the model as the tool's reply.

        ``await ctx.llm(...)`` returns the :class:`LLMReply`. ``stream=True`` returns an
        :class:`LLMStream` of text deltas instead. ``output_type=Model`` (a pydantic model) asks for
        JSON matching it, validates the reply, sends the validation error back for at most
        ``output_retries`` more replies, and returns the model instance (else raises
        :class:`OutputValidationError`). ``retry`` (a :class:`Retry` or a number of retries)
        retries failed requests with backoff; it defaults to the LLM's ``retry``.
        """
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError("max_turns must be an int >= 1")
        if not isinstance(output_retries, int) or output_retries < 0:
            raise ValueError("output_retries must be an int >= 0")
        policy = as_retry(retry, what="retry") if retry is not None else self._state.llm.retry
        call = _Call(system, max_tokens, temperature, tools, max_turns, stop, extra_body, new_session, policy)
        if stream:
            if output_type is not None:
                raise TypeError("ctx.llm(): stream=True cannot be combined with output_type=")
            return LLMStream(self._conversation(prompt, call, stream=True))
        if output_type is not None:
            return self._structured(prompt, call, check_output_type(output_type), output_retries)
        return self._complete(prompt, call)

    async def _complete(self, prompt: str | Sequence[Message], call: _Call) -> LLMReply:
        reply: LLMReply | None = None
        async with aclosing(self._conversation(prompt, call, stream=False)) as items:
            async for item in items:
                if isinstance(item, LLMReply):
                    reply = item
        assert reply is not None
        return reply

    async def _structured(
        self, prompt: str | Sequence[Message], call: _Call, output_type: type[M], output_retries: int
    ) -> M:
        ask = instructions(output_type)
        if isinstance(prompt, str):
            prompt = f"{prompt}\n\n{ask}"
        else:
            prompt = [*prompt, {"role": "user", "content": ask}]
        call = replace(call, response_format=response_format(output_type))
        for attempt in range(1, output_retries + 2):
            reply = await self._complete(prompt, call)
            try:
                return parse_output(output_type, reply.text)
            except ValueError as exc:
                detail = str(exc)
            if attempt > output_retries:
                raise OutputValidationError(self.node, output_type, reply.text, detail, attempt)
            prompt = retry_prompt(detail)
            call = replace(call, system=None, new_session=False)
        raise AssertionError("unreachable")

    async def _conversation(
        self, prompt: str | Sequence[Message], call: _Call, *, stream: bool
    ) -> AsyncGenerator[str | LLMReply, None]:
        """The model-driven loop: yields text deltas (when streaming), then the final reply."""
        self._append_prompt(prompt, call)
        offered = [self._tool(t) for t in (call.tools if call.tools is not None else self._node.tools)]
        by_name = {t.name: t for t in offered}
        schemas = [t.openai_schema() for t in offered]
        usage = Usage()
        latency = 0.0
        turns = 0
        while True:
            turns += 1
            last = turns >= call.max_turns
            reply: LLMReply | None = None
            parts: list[str] = []
            try:
                async with aclosing(
                    self._request(
                        schemas,
                        offered,
                        stream=stream,
                        policy=call.retry,
                        tool_choice="none" if (schemas and last) else None,
                        max_tokens=call.max_tokens if call.max_tokens is not None else self._node.max_tokens,
                        temperature=call.temperature
                        if call.temperature is not None
                        else self._node.temperature,
                        stop=call.stop,
                        extra_body={**(self._node.extra_body or {}), **(call.extra_body or {})} or None,
                        response_format=None if schemas else call.response_format,
                    )
                ) as items:
                    async for item in items:
                        if isinstance(item, LLMReply):
                            reply = item
                        else:
                            parts.append(item)
                            yield item
            finally:
                if reply is None and parts:  # stopped mid-stream: keep what the model said
                    self.messages.append({"role": "assistant", "content": "".join(parts)})
            assert reply is not None
            usage = usage + reply.usage
            latency += reply.latency_s
            self.messages.append(reply.message())
            if not reply.tool_calls or not schemas:
                reply.usage, reply.turns, reply.latency_s = usage, turns, latency
                yield reply
                return
            if last:
                raise ToolError(
                    f"node {self.node!r}: the model still calls tools after max_turns={call.max_turns}",
                    tool=reply.tool_calls[0].name,
                )
            contents = await self._tool_calls(reply.tool_calls, by_name)
            for tool_call, content in zip(reply.tool_calls, contents, strict=True):
                self.messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": content})

    def _append_prompt(self, prompt: str | Sequence[Message], call: _Call) -> None:
        if call.new_session:
            self.messages = []
            self._session_n += 1
            self._turn = 0
        system = call.system if call.system is not None else self._node.system
        if not self.messages:
            if system:
                self.messages.append({"role": "system", "content": system})
        elif system is not None and self._system() not in (None, system):
            raise ValueError(
                f"node {self.node!r}: system= differs from this session's system prompt; "
                "pass new_session=True to start a new conversation"
            )
        if isinstance(prompt, str):
            self.messages.append({"role": "user", "content": prompt})
        else:
            self.messages.extend(dict(m) for m in prompt)

    def _system(self) -> str | None:
        if self.messages and self.messages[0].get("role") == "system":
            return self.messages[0].get("content")
        return None

    async def _request(
        self,
        schemas: list[dict[str, Any]],
        offered: list[Tool],
        *,
        stream: bool,
        policy: Retry | None,
        **kwargs: Any,
    ) -> AsyncIterator[str | LLMReply]:
        """One request of the conversation, retried per ``policy``; yields deltas, then the reply."""
        state, res, llm = self._state, self._result, self._state.llm
        meta = RequestMeta(
            session_id=self.session_id,
            run_id=self.run_id,
            node=self.node,
            agent_type=self.agent_type,
            turn=self._turn,
            importance=float(self._node.importance),
            graph=self.meta,
            # With tool_choice "none" the model cannot call an offered tool (only a declared call
            # in code can follow): announcing one would start a stall that never ends.
            next_stall=self._next_stall(offered if kwargs.get("tool_choice") != "none" else []),
            stall_events=state.reports_stalls,
        )
        if kwargs.get("response_format") is not None and not llm.supports_response_format:
            kwargs["response_format"] = None
        own_retries = 0 if policy is not None else None  # our policy replaces the client's retries
        dropped_format = False
        attempt = 0
        retries = 0
        while True:
            attempt += 1
            started = time.perf_counter()
            delivered = False
            finished = False
            try:
                model = await llm.resolve_model()
                state.emit(
                    "llm_started",
                    self.node,
                    session_id=self.session_id,
                    turn=meta.turn,
                    attempt=attempt,
                    model=model,
                    stream=stream,
                    max_tokens=kwargs.get("max_tokens"),
                    temperature=kwargs.get("temperature"),
                    server=llm.base_url,
                )
                reply: LLMReply | None = None
                if stream:
                    async with aclosing(
                        llm.chat_stream(
                            self.messages, meta=meta, tools=schemas, max_retries=own_retries, **kwargs
                        )
                    ) as it:
                        async for item in it:
                            if isinstance(item, LLMReply):
                                reply = item
                            else:
                                delivered = True
                                yield item
                else:
                    reply = await llm.chat(
                        self.messages,
                        meta=meta,
                        tools=schemas,
                        max_retries=own_retries,
                        **kwargs,
                    )
                assert reply is not None
                finished = True
            except Exception as exc:
                res.llm_s += time.perf_counter() - started
                res.llm_calls += 1
                finished = True
                delay: float | None = None
                if (
                    kwargs.get("response_format") is not None
                    and isinstance(exc, openai.BadRequestError)
                    and not delivered
                ):
                    # Maybe the server does not take response_format: ask once more without it
                    # (remembered only if that works, so an unrelated 400 does not switch it off).
                    kwargs["response_format"] = None
                    dropped_format = True
                    delay = 0.0
                elif (
                    policy is not None
                    and not delivered
                    and policy.should_retry(exc, retries + 1, LLM_TRANSIENT_ERRORS)
                ):
                    retries += 1
                    delay = policy.delay(retries)
                state.emit(
                    "llm_failed",
                    self.node,
                    session_id=self.session_id,
                    turn=meta.turn,
                    attempt=attempt,
                    error=f"{type(exc).__name__}: {exc}"[:500],
                    retry_in_s=delay,
                )
                if delay is None:
                    raise
                await anyio.sleep(delay)
                continue
            finally:
                if not finished:  # cancelled, or the stream was closed early
                    res.llm_s += time.perf_counter() - started
                    res.llm_calls += 1
                    state.emit(
                        "llm_failed",
                        self.node,
                        session_id=self.session_id,
                        turn=meta.turn,
                        attempt=attempt,
                        error="cancelled",
                        retry_in_s=None,
                    )
            break
        if dropped_format:
            llm.supports_response_format = False
        res.llm_s += time.perf_counter() - started
        res.llm_calls += 1
        self._turn += 1
        res.usage = res.usage + reply.usage
        state.emit(
            "llm_finished",
            self.node,
            session_id=self.session_id,
            turn=meta.turn,
            latency_s=reply.latency_s,
            finish_reason=reply.finish_reason,
            prompt_tokens=reply.usage.prompt_tokens,
            completion_tokens=reply.usage.completion_tokens,
            tool_calls=[c.name for c in reply.tool_calls],
            model=reply.model,
            attempt=attempt,
        )
        yield reply

    def _next_stall(self, offered: list[Tool]) -> NextStall | None:
        calls = self._state.calls[self.node]
        tool: Tool | None = None
        if self._next_call < len(calls):
            tool = self._state.app.tools[calls[self._next_call]]
        elif len(offered) == 1:
            tool = offered[0]
        elif calls and self._next_call > 0:
            # Past its declared sequence an agent that calls tools in a loop calls the last one
            # again: a hint only (the server saves the KV early; a wrong guess costs one copy).
            tool = self._state.app.tools[calls[-1]]
        if tool is None:
            return None
        return NextStall(tool=tool.name, kind=tool.kind, predicted_s=tool.predicted_s)

    async def _tool_calls(self, calls: list[ToolCall], by_name: dict[str, Tool]) -> list[str]:
        """Run one turn's tool calls concurrently; their replies in the model's order.

        A failure that must fail the node (not a :class:`ToolError`) cancels the other calls and
        is raised as it is (the first one in the model's order).
        """
        if len(calls) == 1:
            return [await self._model_tool_call(calls[0], by_name)]
        contents = [""] * len(calls)
        failures: list[tuple[int, Exception]] = []

        async def one(index: int, call: ToolCall) -> None:
            try:
                contents[index] = await self._model_tool_call(call, by_name)
            except Exception as exc:
                failures.append((index, exc))
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            for index, call in enumerate(calls):
                tg.start_soon(one, index, call, name=f"tokencake tool {call.name}")
        if failures:
            raise min(failures, key=lambda f: f[0])[1]
        return contents

    async def _model_tool_call(self, call: ToolCall, by_name: dict[str, Tool]) -> str:
        tool = by_name.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; available tools: {', '.join(by_name)}"
        if call.raw_arguments is not None:
            got = call.raw_arguments[:200]
            return f"error: arguments for {call.name!r} must be a JSON object, got: {got}"
        try:
            args = tool.validate(call.arguments)
            value = await self._run_tool(tool, args, call_id=call.id)
        except ToolError as exc:
            return f"error: {exc}"
        return tool_content(value)

    # ------------------------------------------------------------------ tools

    async def call(self, tool: Ref, /, **kwargs: Any) -> Any:
        """Call a tool of the app with keyword arguments (graph-fixed call, stall-wrapped).

        Arguments are validated first (:class:`ToolArgumentsError` naming the tool); the tool's own
        exception propagates after its retries; a timeout raises :class:`ToolTimeout`.
        """
        try:
            resolved = self._tool(tool)
        except KeyError as exc:
            raise ToolError(str(exc.args[0]), tool=str(tool)) from None
        args = resolved.validate(kwargs)
        calls = self._state.calls[self.node]
        if resolved.name in calls[self._next_call :]:
            self._next_call = calls.index(resolved.name, self._next_call) + 1
        return await self._run_tool(resolved, args)

    def _tool(self, ref: Ref) -> Tool:
        return self._state.app.get_tool(ref)

    async def _run_tool(self, tool: Tool, args: dict[str, Any], *, call_id: str | None = None) -> Any:
        """Run ``tool`` with its retry policy; every attempt is one stall (begin before, end after)."""
        state, res = self._state, self._result
        attempt = 0
        while True:
            attempt += 1
            begin = StallBegin(
                stall_id=state.next_stall_id(self.node),
                session_id=self.session_id,
                run_id=self.run_id,
                node=self.node,
                agent_type=self.agent_type,
                tool=tool.name,
                kind=tool.kind,
                predicted_s=tool.predicted_s,
                stages=tool.stages,
                attempt=attempt,
                ts=time.time(),
            )
            stall = StallScope(begin, state.stall_begin, state.stall_end)
            error: Exception | None = None
            value: Any = None
            retry_in: float | None = None
            stall_start = time.perf_counter()
            state.emit(
                "tool_started",
                self.node,
                tool=tool.name,
                stall_id=begin.stall_id,
                attempt=attempt,
                kind=tool.kind,
                predicted_s=tool.predicted_s,
                call_id=call_id,
                session_id=self.session_id,
            )
            try:
                async with stall:
                    try:
                        with anyio.move_on_after(tool.timeout) as scope:
                            value = await tool.invoke(args)
                        if scope.cancelled_caught:
                            error = ToolTimeout(tool.name, tool.timeout or 0.0, attempt)
                            stall.fail("timeout", str(error))
                    except Exception as exc:
                        error = exc
                        stall.fail("error", f"{type(exc).__name__}: {exc}")
            finally:
                res.tool_s += stall.duration_s
                res.stall_s += time.perf_counter() - stall_start
                res.tool_calls += 1
                if error is not None and tool.should_retry(error, attempt):
                    retry_in = tool.retry.delay(attempt)
                state.emit(
                    "tool_finished",
                    self.node,
                    tool=tool.name,
                    stall_id=begin.stall_id,
                    attempt=attempt,
                    outcome=stall.outcome,
                    duration_s=stall.end.duration_s if stall.end else stall.duration_s,
                    error=stall.end.error if stall.end else None,
                    retry_in_s=retry_in,
                )
            if error is None:
                return value
            if retry_in is None:
                raise error
            await anyio.sleep(retry_in)

    # ------------------------------------------------------------------ fan-out

    async def fan_out(
        self, template: Ref, items: Iterable[Any], *, max_concurrency: int | None = None
    ) -> list[Any]:
        """Run template node ``template`` once per item, concurrently, and return their outputs in order.

        Each instance is a node of its own (``template[k]``: own conversation, session, timings,
        events) that receives its item as ``inputs``; it joins back into this node. While it waits,
        this node gives its ``max_concurrency`` slot to the instances. The first instance that
        raises cancels the others and its exception is raised here.
        """
        return await self._state.fan_out(self, template, list(items), max_concurrency)


def tool_content(value: Any) -> str:
    """A tool's return value as the text of a tool message."""
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    try:
        return json.dumps(jsonable(value), ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)
