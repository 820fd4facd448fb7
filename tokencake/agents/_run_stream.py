"""``RunStream``: a run whose events are read as they happen (``app.stream(...)``).

A context manager, like ``httpx.AsyncClient.stream``: the run lives in a task group that the
``async with`` block owns, so leaving the block (early, by exception or by cancellation) always
cancels the run and waits for its stall ends to be sent; no run outlives its reader.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

import anyio

from ._errors import NodeFailed, RunTimeout
from ._result import RunEvent, RunResult

if TYPE_CHECKING:
    from ._runner import RunState


class RunStream:
    """The events of one run: ``async with app.stream(...) as run: async for event in run: ...``.

    Iterating yields every :class:`RunEvent` of the run, the wire-level ``stall_begin`` /
    ``stall_end`` events (``data["event"]``) and, last, ``run_result`` (``data["result"]``: the
    :class:`RunResult`). A failed or timed-out run then raises :class:`NodeFailed` /
    :class:`RunTimeout` from the iteration, as ``await app.run`` would. :meth:`cancel` stops the
    run; the iteration then ends normally and :attr:`result` is the partial result (status
    ``cancelled``).
    """

    def __init__(self, build: Callable[[Callable[[RunEvent], None]], RunState]) -> None:
        self._send, self._receive = anyio.create_memory_object_stream[RunEvent](math.inf)
        self._state = build(self._listen)  # validates now: errors surface at app.stream()
        self._tg: anyio.abc.TaskGroup | None = None
        self._scope: anyio.CancelScope | None = None
        self._error: Exception | None = None
        self._entered = False
        #: The run's result once it ended (partial when it failed, timed out or was cancelled).
        self.result: RunResult | None = None

    def _listen(self, event: RunEvent) -> None:
        try:
            self._send.send_nowait(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # nobody reads any more; the run must not notice

    @property
    def run_id(self) -> str:
        return self._state.run_id

    def cancel(self) -> None:
        """Cancel the run (its open stalls still get their end events)."""
        if self._scope is not None:
            self._scope.cancel()

    async def __aenter__(self) -> RunStream:
        if self._entered:
            raise RuntimeError("a RunStream runs once; call app.stream(...) again for another run")
        self._entered = True
        self._scope = anyio.CancelScope()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._run, name=f"tokencake run {self._state.run_id}")
        return self

    async def _run(self) -> None:
        state = self._state
        assert self._scope is not None
        try:
            with self._scope:
                try:
                    self.result = await state.execute()
                except (NodeFailed, RunTimeout) as exc:
                    self._error, self.result = exc, exc.result
                except Exception as exc:  # raised from the iteration, not from the task group
                    self._error = exc
        finally:
            if self.result is None:
                self.result = state.result
            if self.result is not None:
                data = {"result": self.result, "status": self.result.status}
                self._send.send_nowait(RunEvent("run_result", None, time.time(), data, state.run_id))
            self._send.close()

    def __aiter__(self) -> RunStream:
        return self

    async def __anext__(self) -> RunEvent:
        if self._tg is None:
            raise RuntimeError("use `async with app.stream(...) as run:` and iterate over `run`")
        try:
            return await self._receive.receive()
        except anyio.EndOfStream:
            if self._error is not None:
                error, self._error = self._error, None
                raise error from error.__cause__
            raise StopAsyncIteration from None

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        self.cancel()  # leaving the block ends the run (a no-op when it already ended)
        try:
            if exc is not None and not isinstance(exc, anyio.get_cancelled_exc_class()):
                # Wait for the cancelled run, then let the block's own exception propagate as it
                # is (handing it to the task group would wrap it in an exception group).
                await self._tg.__aexit__(None, None, None)
                return None
            return await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            self._receive.close()
