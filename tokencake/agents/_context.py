"""``Context``: what a node function uses to talk to the model and call tools.

One ``Context`` per node per run. It owns the node's conversation (so consecutive ``ctx.llm`` calls
continue one session whose KV the server can keep) and wraps every tool attempt in stall events.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import BaseModel

from tokencake.events import GraphMeta, NextStall, RequestMeta, StallBegin, StallEnd

from ._errors import ToolError, ToolTimeout
from ._llm import LLMReply, ToolCall, Usage
from ._result import jsonable
from ._tool import Tool

if TYPE_CHECKING:
    from ._app import Node, Ref
    from ._result import NodeResult
    from ._runner import RunState

Message = dict[str, Any]


class Context:
    """The handle a node function receives as ``ctx``.

    ``inputs`` are the run inputs (read-only); ``messages`` is the node's conversation so far.
    """

    def __init__(self, state: RunState, node: Node, result: NodeResult) -> None:
        self._state = state
        self._node = node
        self._result = result
        self.node = node.name
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

    async def llm(
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
    ) -> LLMReply:
        """Send ``prompt`` (text, or messages to append) in this node's conversation.

        ``system``, ``max_tokens`` and ``temperature`` default to the node's options. With tools
        (``tools=`` or the node's ``tools``) the model-driven loop runs: each tool call is validated
        and executed (stall-wrapped) and its result sent back, for at most ``max_turns`` requests;
        the last request forbids tools (``tool_choice="none"``). A :class:`ToolError` (bad arguments,
        timeout, or raised by the tool) goes back to the model as the tool's reply.
        """
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        if new_session:
            self.messages = []
            self._session_n += 1
            self._turn = 0
        system = system if system is not None else self._node.system
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
        offered = [self._tool(t) for t in (tools if tools is not None else self._node.tools)]
        by_name = {t.name: t for t in offered}
        schemas = [t.openai_schema() for t in offered]
        usage = Usage()
        latency = 0.0
        turns = 0
        while True:
            turns += 1
            last = turns >= max_turns
            reply = await self._request(
                schemas,
                offered,
                tool_choice="none" if (schemas and last) else None,
                max_tokens=max_tokens if max_tokens is not None else self._node.max_tokens,
                temperature=temperature if temperature is not None else self._node.temperature,
                stop=stop,
                extra_body=extra_body,
            )
            usage = usage + reply.usage
            latency += reply.latency_s
            self.messages.append(reply.message())
            if not reply.tool_calls or not schemas:
                reply.usage, reply.turns, reply.latency_s = usage, turns, latency
                return reply
            if last:
                raise ToolError(
                    f"node {self.node!r}: the model still calls tools after max_turns={max_turns}",
                    tool=reply.tool_calls[0].name,
                )
            for call in reply.tool_calls:
                content = await self._model_tool_call(call, by_name)
                self.messages.append({"role": "tool", "tool_call_id": call.id, "content": content})

    def _system(self) -> str | None:
        if self.messages and self.messages[0].get("role") == "system":
            return self.messages[0].get("content")
        return None

    async def _request(self, schemas: list[dict[str, Any]], offered: list[Tool], **kwargs: Any) -> LLMReply:
        state, res = self._state, self._result
        meta = RequestMeta(
            session_id=self.session_id,
            run_id=self.run_id,
            node=self.node,
            agent_type=self.agent_type,
            turn=self._turn,
            importance=float(self._node.importance),
            graph=self.meta,
            next_stall=self._next_stall(offered),
        )
        state.emit("llm_started", self.node, session_id=self.session_id, turn=self._turn)
        started = time.perf_counter()
        try:
            reply = await state.llm.chat(self.messages, meta=meta, tools=schemas, **kwargs)
        finally:
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
        )
        return reply

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

    async def _model_tool_call(self, call: ToolCall, by_name: dict[str, Tool]) -> str:
        tool = by_name.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; available tools: {', '.join(by_name)}"
        if call.raw_arguments is not None:
            got = call.raw_arguments[:200]
            return f"error: arguments for {call.name!r} must be a JSON object, got: {got}"
        try:
            args = tool.validate(call.arguments)
            value = await self._run_tool(tool, args)
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

    async def _run_tool(self, tool: Tool, args: dict[str, Any]) -> Any:
        """Run ``tool`` with retries; every attempt is one stall (begin before, end after, always)."""
        state, res = self._state, self._result
        error: BaseException | None = None
        for attempt in range(1, tool.retries + 2):
            stall_id = state.next_stall_id(self.node)
            begin = StallBegin(
                stall_id=stall_id,
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
            outcome, detail, value = "cancelled", None, None
            stall_start = time.perf_counter()
            tool_s = 0.0
            state.emit("tool_started", self.node, tool=tool.name, stall_id=stall_id, attempt=attempt)
            try:
                await state.stall_begin(begin)
                started = time.perf_counter()
                try:
                    with anyio.move_on_after(tool.timeout) as scope:
                        value = await tool.invoke(args)
                        outcome = "ok"
                    if scope.cancelled_caught:
                        outcome = "timeout"
                        error = ToolTimeout(tool.name, tool.timeout or 0.0, attempt)
                        detail = str(error)
                except Exception as exc:
                    outcome, error = "error", exc
                    detail = f"{type(exc).__name__}: {exc}"
                finally:
                    tool_s = time.perf_counter() - started
            finally:
                end = StallEnd(
                    stall_id=stall_id,
                    session_id=begin.session_id,
                    run_id=self.run_id,
                    node=self.node,
                    tool=tool.name,
                    outcome=outcome,  # type: ignore[arg-type]
                    duration_s=max(0.0, tool_s),
                    error=detail[:2000] if detail else None,
                    ts=time.time(),
                )
                with anyio.CancelScope(shield=True):
                    await state.stall_end(end)
                res.tool_s += tool_s
                res.stall_s += time.perf_counter() - stall_start
                res.tool_calls += 1
                state.emit(
                    "tool_finished",
                    self.node,
                    tool=tool.name,
                    stall_id=stall_id,
                    attempt=attempt,
                    outcome=outcome,
                    duration_s=end.duration_s,
                    error=end.error,
                )
            if outcome == "ok":
                return value
        assert error is not None
        raise error


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
