"""One tool call of a node: each attempt is a stall (begin before, end after), retried per its policy."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio

from tokencake.events import StallBegin

from ._context_state import ContextState
from ._errors import ToolTimeout
from ._stall import StallScope
from ._tool import Tool

if TYPE_CHECKING:
    from ._node import Ref


class ToolRunner(ContextState):
    """Resolves the app's tools and runs them as stalls (events, timings, retries)."""

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
