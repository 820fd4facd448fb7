"""The runner: executes an app's DAG on anyio.

A node starts the moment its own predecessors are done (no lock-step levels), so independent
branches overlap. The first failing node cancels the rest of the run and is reported as
:class:`NodeFailed`; a ``timeout`` cancels the run as :class:`RunTimeout`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import types
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import anyio
import networkx as nx

from tokencake.events import GraphMeta, StallBegin, StallEnd

from ._context import Context
from ._errors import MissingInput, NodeFailed, RunTimeout
from ._llm import LLM
from ._result import EventKind, NodeResult, RunEvent, RunResult
from ._stall import StallHook, StallHooks

if TYPE_CHECKING:
    from ._app import App


async def execute(
    app: App,
    *,
    llm: LLM | None,
    stall: StallHook | Sequence[StallHook] | Literal[False] | None,
    timeout: float | None,
    max_concurrency: int | None,
    run_id: str | None,
    observer: Callable[[RunEvent], None] | None,
    inputs: Mapping[str, Any],
) -> RunResult:
    """Validate, run and return the result (see ``App.run``)."""
    app.validate()
    missing = [name for name in app.inputs if name not in inputs]
    if missing:
        raise MissingInput(app.name, missing)
    if max_concurrency is not None and (not isinstance(max_concurrency, int) or max_concurrency < 1):
        raise ValueError("max_concurrency must be a positive int or None")
    if timeout is not None and not timeout > 0:
        raise ValueError("timeout must be > 0 seconds or None")
    if run_id is not None and not (0 < len(run_id) <= 80):
        raise ValueError("run_id must be 1..80 characters")
    own_llm = llm is None
    llm = llm if llm is not None else LLM()
    state = RunState(
        app,
        llm=llm,
        hooks=_hooks(stall, llm),
        run_id=run_id or f"run-{uuid.uuid4().hex[:12]}",
        inputs=inputs,
        observer=observer,
    )
    try:
        return await state.run(timeout=timeout, max_concurrency=max_concurrency)
    finally:
        if own_llm:
            with anyio.CancelScope(shield=True):
                await llm.aclose()


def _hooks(stall: StallHook | Sequence[StallHook] | Literal[False] | None, llm: LLM) -> list[StallHook]:
    if stall is False:
        return []
    if stall is None:
        hooks: list[StallHook] = []
    elif isinstance(stall, Sequence):
        hooks = list(stall)
    else:
        hooks = [stall]
    for hook in hooks:
        if not (callable(getattr(hook, "begin", None)) and callable(getattr(hook, "end", None))):
            raise TypeError(f"stall hook {hook!r} needs async begin(ev) and end(ev) methods")
    reporter = llm.stall_reporter()
    if reporter is not None and all(h is not reporter for h in hooks):
        hooks.append(reporter)
    return hooks


class RunState:
    """Everything one run shares between its nodes (results, event log, hooks, counters)."""

    def __init__(
        self,
        app: App,
        *,
        llm: LLM,
        hooks: list[StallHook],
        run_id: str,
        inputs: Mapping[str, Any],
        observer: Callable[[RunEvent], None] | None,
    ) -> None:
        analysis = app._analysis()
        self.app = app
        self.llm = llm
        self.hooks = StallHooks(hooks)
        self.run_id = run_id
        self.inputs: Mapping[str, Any] = types.MappingProxyType(dict(inputs))
        self.observer = observer
        self.graph: nx.DiGraph = analysis.graph
        self.metas: dict[str, GraphMeta] = analysis.metas
        self.calls: dict[str, list[str]] = analysis.calls
        self.order = list(nx.lexicographical_topological_sort(self.graph, key=str))
        self.results = {name: NodeResult(name) for name in self.order}
        self.events: list[RunEvent] = []
        self.stall_events: list[StallBegin | StallEnd] = []
        self.failure: tuple[str, Exception] | None = None
        self._stall_ids = itertools.count(1)
        self._observer_warned = False
        self._pending = {name: self.graph.in_degree(name) for name in self.order}
        self._tg: anyio.abc.TaskGroup | None = None
        self._limiter: anyio.CapacityLimiter | None = None

    # ------------------------------------------------------------------ events

    def emit(self, kind: EventKind, node: str | None, **data: Any) -> None:
        event = RunEvent(kind, node, time.time(), data)
        self.events.append(event)
        if self.observer is not None:
            try:
                self.observer(event)
            except Exception as exc:  # a broken live view must not break the run
                if not self._observer_warned:
                    self._observer_warned = True
                    warnings.warn(f"run observer failed: {exc!r}", RuntimeWarning, stacklevel=2)

    def next_stall_id(self, node: str) -> str:
        return f"{self.run_id}:{node}:{next(self._stall_ids)}"

    async def stall_begin(self, ev: StallBegin) -> None:
        self.stall_events.append(ev)
        await self.hooks.begin(ev)

    async def stall_end(self, ev: StallEnd) -> None:
        self.stall_events.append(ev)
        await self.hooks.end(ev)

    # ------------------------------------------------------------------ execution

    async def run(self, *, timeout: float | None, max_concurrency: int | None) -> RunResult:
        self._limiter = anyio.CapacityLimiter(max_concurrency) if max_concurrency else None
        started = time.time()
        self.emit("run_started", None, app=self.app.name, run_id=self.run_id, inputs=list(self.inputs))
        status = "cancelled"
        try:
            with anyio.move_on_after(timeout) as deadline:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    for name in self.order:
                        if self._pending[name] == 0:
                            tg.start_soon(self._node_task, name, name=f"tokencake node {name}")
            if self.failure is not None:
                status = "failed"
            elif deadline.cancelled_caught:
                status = "timeout"
            else:
                status = "ok"
        finally:
            self._close_nodes()
            self.emit("run_finished", None, status=status)
        result = RunResult(
            run_id=self.run_id,
            app=self.app.name,
            nodes=self.results,
            sinks=[n for n in self.order if self.graph.out_degree(n) == 0],
            events=self.events,
            stall_events=self.stall_events,
            started=started,
            finished=time.time(),
            status=status,
        )
        if self.failure is not None:
            node, exc = self.failure
            raise NodeFailed(node, exc, result) from exc
        if status == "timeout":
            pending = [n for n, r in self.results.items() if r.status != "ok"]
            raise RunTimeout(timeout or 0.0, pending, result)
        return result

    def _close_nodes(self) -> None:
        now = time.time()
        for res in self.results.values():
            if res.status in ("ready", "running"):
                res.status = "cancelled"
                res.finished = res.finished or now

    async def _node_task(self, name: str) -> None:
        node = self.app.nodes[name]
        res = self.results[name]
        res.status = "ready"
        res.ready = time.time()
        self.emit("node_ready", name)
        limiter = self._limiter if self._limiter is not None else contextlib.nullcontext()
        async with limiter:
            res.started = time.time()
            res.queue_s = res.started - res.ready
            res.status = "running"
            self.emit("node_started", name, queue_s=res.queue_s)
            ctx = Context(self, node, res)
            inputs = {p: self.results[p].output for p in sorted(self.graph.predecessors(name), key=str)}
            try:
                if node.is_async:
                    output = await node.fn(ctx, inputs)
                else:
                    output = await anyio.to_thread.run_sync(node.fn, ctx, inputs, abandon_on_cancel=True)
            except anyio.get_cancelled_exc_class():
                res.status = "cancelled"
                res.finished = time.time()
                self.emit("node_failed", name, cancelled=True, error="cancelled")
                raise
            except Exception as exc:
                res.status = "failed"
                res.finished = time.time()
                res.error = f"{type(exc).__name__}: {exc}"
                self.emit("node_failed", name, cancelled=False, error=res.error)
                if self.failure is None:
                    self.failure = (name, exc)
                assert self._tg is not None
                self._tg.cancel_scope.cancel()
                return
            res.output = output
            res.status = "ok"
            res.finished = time.time()
            self.emit("node_finished", name, wall_s=res.wall_s)
        assert self._tg is not None
        for succ in sorted(self.graph.successors(name), key=str):
            self._pending[succ] -= 1
            if self._pending[succ] == 0:
                self._tg.start_soon(self._node_task, succ, name=f"tokencake node {succ}")
