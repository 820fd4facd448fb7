"""The runner: executes an app's DAG on anyio.

A node starts the moment its own predecessors are done (no lock-step levels), so independent
branches overlap. The first failing node cancels the rest of the run and is reported as
:class:`NodeFailed`; a ``timeout`` cancels the run as :class:`RunTimeout`. Whatever way a run
ends, its (possibly partial) :class:`RunResult` is built.
"""

from __future__ import annotations

import itertools
import time
import types
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import anyio
import networkx as nx

from tokencake.events import GraphMeta, StallBegin, StallEnd

from ._context import Context
from ._errors import MissingInput, NodeFailed, RunTimeout
from ._llm import LLM
from ._loop import stray_cancellation_fails
from ._observe import Observer, Observers
from ._result import EventKind, NodeResult, RunEvent, RunResult
from ._stall import HttpStallReporter, StallHook, StallHooks

if TYPE_CHECKING:
    from ._app import App
    from ._node import Node, Ref

#: Event kinds only ``app.stream()`` sees (not recorded in ``RunResult.events``).
STREAM_ONLY: frozenset[str] = frozenset({"stall_begin", "stall_end", "run_result"})


def prepare(
    app: App,
    *,
    llm: LLM | None,
    stall: StallHook | Sequence[StallHook] | Literal[False] | None,
    timeout: float | None,
    max_concurrency: int | None,
    run_id: str | None,
    observer: Observer | Sequence[Observer] | None,
    inputs: Mapping[str, Any],
    listener: Callable[[RunEvent], None] | None = None,
) -> RunState:
    """Validate everything a run needs before it starts (errors surface at the call site)."""
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
    observers = Observers(observer)
    own_llm = llm is None
    llm = llm if llm is not None else LLM()
    return RunState(
        app,
        llm=llm,
        own_llm=own_llm,
        hooks=_hooks(stall, llm),
        run_id=run_id or f"run-{uuid.uuid4().hex[:12]}",
        inputs=inputs,
        observers=observers,
        listener=listener,
        timeout=timeout,
        max_concurrency=max_concurrency,
    )


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


class _Slot:
    """A node's ``max_concurrency`` slot; a node that fans out lends it to its instances.

    The slot itself is the limiter's borrower, not the task that took it: a node may fan out
    from a child task (``asyncio.gather``, a task group), and several fan-outs of one node may
    run at once — the slot is lent while any runs and taken back when the last one ends.
    """

    def __init__(self, limiter: anyio.CapacityLimiter | None) -> None:
        self.limiter = limiter
        self.held = False
        self._lent = 0

    async def acquire(self) -> None:
        if self.limiter is not None and not self.held:
            await self.limiter.acquire_on_behalf_of(self)
            self.held = True

    def release(self) -> None:
        if self.limiter is not None and self.held:
            self.held = False
            self.limiter.release_on_behalf_of(self)

    def lend(self) -> None:
        """A fan-out starts: its instances may use this node's slot."""
        self._lent += 1
        if self._lent == 1:
            self.release()

    async def take_back(self) -> None:
        """A fan-out ended: the last one to end takes the slot back."""
        self._lent -= 1
        if self._lent == 0:
            await self.acquire()


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
        observers: Observers,
        own_llm: bool = False,
        listener: Callable[[RunEvent], None] | None = None,
        timeout: float | None = None,
        max_concurrency: int | None = None,
    ) -> None:
        analysis = app._analysis()
        self.app = app
        self.llm = llm
        self.own_llm = own_llm
        self.hooks = StallHooks(hooks)
        #: Whether this run's tool calls reach a server's events listener: the requests say so
        #: (``RequestMeta.stall_events``), and a server told "no" derives stalls itself.
        own = llm.stall_reporter()
        self.reports_stalls = any(isinstance(h, HttpStallReporter) or h is own for h in hooks)
        self.run_id = run_id
        self.inputs: Mapping[str, Any] = types.MappingProxyType(dict(inputs))
        self.observers = observers
        self.listener = listener
        self.timeout = timeout
        self.max_concurrency = max_concurrency
        #: The run's DAG: the app's graph plus the instances ``fan_out`` adds.
        self.graph: nx.DiGraph = analysis.graph.copy()
        self.metas: dict[str, GraphMeta] = dict(analysis.metas)
        self.calls: dict[str, list[str]] = dict(analysis.calls)
        self.weights: dict[str, float] = analysis.weights
        self.order = list(nx.lexicographical_topological_sort(analysis.graph, key=str))
        self.sinks = [n for n in self.order if analysis.graph.out_degree(n) == 0]
        self.results = {name: NodeResult(name) for name in self.order}
        self.events: list[RunEvent] = []
        self.stall_events: list[StallBegin | StallEnd] = []
        self.failure: tuple[str, Exception] | None = None
        self.result: RunResult | None = None
        self._stall_ids = itertools.count(1)
        #: Per run: a run_id reused for a retry must not repeat the first run's stall ids (the
        #: server would answer the second run's events as duplicates and do nothing for it).
        self._stall_token = uuid.uuid4().hex[:8]
        self._instances: dict[str, itertools.count[int]] = {}
        self._pending = {name: analysis.graph.in_degree(name) for name in self.order}
        self._tg: anyio.abc.TaskGroup | None = None
        self._limiter: anyio.CapacityLimiter | None = None

    # ------------------------------------------------------------------ events

    def emit(self, kind: EventKind, node: str | None, /, **data: Any) -> None:
        event = RunEvent(kind, node, time.time(), data, self.run_id)
        if kind not in STREAM_ONLY:
            self.events.append(event)
            self.observers.deliver(event)
        if self.listener is not None:
            self.listener(event)

    def next_stall_id(self, node: str) -> str:
        """Unique per tool attempt, and at most 190 characters (the wire allows 200)."""
        return f"{self.run_id[:120]}:{node[:50]}:{self._stall_token}:{next(self._stall_ids)}"

    async def stall_begin(self, ev: StallBegin) -> None:
        self.stall_events.append(ev)
        self.emit("stall_begin", ev.node, event=ev)
        await self.hooks.begin(ev)

    async def stall_end(self, ev: StallEnd) -> None:
        self.stall_events.append(ev)
        self.emit("stall_end", ev.node, event=ev)
        await self.hooks.end(ev)

    # ------------------------------------------------------------------ execution

    async def execute(self) -> RunResult:
        """Run, close the LLM if the run created it, and return the result (or raise).

        Async observers are served by a task beside the run; the run returns once they have seen
        every event (up to ``run_finished``).
        """
        error: Exception | None = None
        result: RunResult | None = None
        try:
            async with anyio.create_task_group() as tg:
                self.observers.start(tg)
                try:
                    result = await self.run()
                except Exception as exc:  # raised after the observers are done, not as a group
                    error = exc
                finally:
                    self.observers.close()
        finally:
            if self.own_llm:
                with anyio.CancelScope(shield=True):
                    await self.llm.aclose()
        if error is not None:
            raise error
        assert result is not None
        return result

    async def _check_events(self) -> None:
        """No events listener behind the LLM's own events URL (a router, ``LLM.events_reachable``):
        this run sends it no events, and its requests say so (the server derives the stalls)."""
        own = self.llm.stall_reporter()
        reachable = getattr(self.llm, "events_reachable", None)  # duck-typed LLMs may lack it
        if own is None or reachable is None or all(h is not own for h in self.hooks.hooks):
            return
        if await reachable():
            return
        self.hooks.hooks = [h for h in self.hooks.hooks if h is not own]
        self.reports_stalls = any(isinstance(h, HttpStallReporter) for h in self.hooks.hooks)

    async def run(self) -> RunResult:
        self._limiter = anyio.CapacityLimiter(self.max_concurrency) if self.max_concurrency else None
        await self._check_events()
        started = time.time()
        self.emit("run_started", None, app=self.app.name, run_id=self.run_id, inputs=list(self.inputs))
        status = "cancelled"
        try:
            with anyio.move_on_after(self.timeout) as deadline:
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
            self.result = result = RunResult(
                run_id=self.run_id,
                app=self.app.name,
                nodes=self.results,
                sinks=self.sinks,
                events=self.events,
                stall_events=self.stall_events,
                started=started,
                finished=time.time(),
                status=status,
                graph=self.graph,
            )
            self.emit(
                "run_finished",
                None,
                status=status,
                completed=result.completed,
                unfinished=result.unfinished,
            )
        if self.failure is not None:
            node, exc = self.failure
            raise NodeFailed(node, exc, result) from exc
        if status == "timeout":
            raise RunTimeout(self.timeout or 0.0, result.unfinished, result)
        return result

    def _close_nodes(self) -> None:
        now = time.time()
        for res in self.results.values():
            if res.status in ("ready", "running"):
                res.status = "cancelled"
                res.finished = res.finished or now

    async def _node_task(self, name: str) -> None:
        node = self.app.nodes[name]
        inputs = {p: self.results[p].output for p in sorted(self.graph.predecessors(name), key=str)}
        try:
            await self._run_node(node, name, inputs, parent=None)
        except Exception as exc:
            if self.failure is None:
                self.failure = (name, exc)
            assert self._tg is not None
            self._tg.cancel_scope.cancel()
            return
        assert self._tg is not None
        for succ in sorted(self.graph.successors(name), key=str):
            if succ not in self._pending:
                continue  # a fan-out instance (runs inside its parent), not a DAG node
            self._pending[succ] -= 1
            if self._pending[succ] == 0:
                self._tg.start_soon(self._node_task, succ, name=f"tokencake node {succ}")

    async def _run_node(self, node: Node, name: str, inputs: Any, *, parent: str | None) -> Any:
        """Wait for a slot, run one node (DAG node or fan-out instance) and record its result."""
        res = self.results[name]
        res.status = "ready"
        res.ready = time.time()
        extra = {} if parent is None else {"parent": parent, "template": node.name}
        self.emit("node_ready", name, **extra)
        slot = _Slot(self._limiter)
        try:
            await slot.acquire()
            res.started = time.time()
            res.queue_s = res.started - res.ready
            res.status = "running"
            self.emit("node_started", name, queue_s=res.queue_s, kind=node.kind, **extra)
            ctx = Context(self, node, res, name=name, parent=parent, slot=slot)
            try:
                with stray_cancellation_fails(f"node {name!r}"):
                    if node.is_async:
                        output = await node.fn(ctx, inputs)
                    else:
                        output = await anyio.to_thread.run_sync(node.fn, ctx, inputs, abandon_on_cancel=True)
            except anyio.get_cancelled_exc_class():
                res.status = "cancelled"
                res.finished = time.time()
                self.emit("node_failed", name, cancelled=True, error="cancelled", **extra)
                raise
            except Exception as exc:
                res.status = "failed"
                res.finished = time.time()
                res.error = f"{type(exc).__name__}: {exc}"
                self.emit("node_failed", name, cancelled=False, error=res.error, **extra)
                raise
            res.output = output
            res.status = "ok"
            res.finished = time.time()
            self.emit("node_finished", name, wall_s=res.wall_s, **extra)
            return output
        finally:
            slot.release()

    # ------------------------------------------------------------------ fan-out

    async def fan_out(
        self, ctx: Context, template: Ref, items: list[Any], max_concurrency: int | None
    ) -> list[Any]:
        """Run one instance of ``template`` per item as children of ``ctx.node``; outputs in order."""
        node = self.app.get_template(template)
        if max_concurrency is not None and (not isinstance(max_concurrency, int) or max_concurrency < 1):
            raise ValueError("max_concurrency must be a positive int or None")
        parent = ctx.node
        names = [self._add_instance(node, parent, len(items)) for _ in items]
        outputs: list[Any] = [None] * len(items)
        failures: list[tuple[int, Exception]] = []
        local = anyio.CapacityLimiter(max_concurrency) if max_concurrency else None

        async def one(index: int, name: str, item: Any) -> None:
            try:
                if local is None:
                    outputs[index] = await self._run_node(node, name, item, parent=parent)
                else:
                    async with local:
                        outputs[index] = await self._run_node(node, name, item, parent=parent)
            except Exception as exc:
                failures.append((index, exc))
                tg.cancel_scope.cancel()

        slot: _Slot | None = ctx._slot
        if slot is not None:
            slot.lend()  # the parent only waits: its instances may use its slot
        async with anyio.create_task_group() as tg:
            for index, (name, item) in enumerate(zip(names, items, strict=True)):
                tg.start_soon(one, index, name, item, name=f"tokencake node {name}")
        if slot is not None:  # (not when cancelled: the node is ending and needs no slot)
            await slot.take_back()
        if failures:
            raise min(failures, key=lambda f: f[0])[1]
        return outputs

    def _add_instance(self, node: Node, parent: str, width: int) -> str:
        counter = self._instances.setdefault(node.name, itertools.count())
        name = f"{node.name}[{next(counter)}]"
        up = self.metas[parent]
        meta = GraphMeta(
            depth=up.depth + 1,
            remaining_depth=up.remaining_depth,
            in_degree=1,
            out_degree=0,
            fanout_width=max(1, width),
            join_group=parent,
            on_critical_path=up.on_critical_path,
            slack_s=up.slack_s,
            critical_path_s=up.critical_path_s,
        )
        self.metas[name] = meta
        self.calls[name] = self.calls[node.name]
        self.results[name] = NodeResult(name)
        self.graph.add_node(
            name,
            kind=node.kind,
            fn=node.fn,
            template=node.name,
            parent=parent,
            options=node.options(),
            calls=self.calls[node.name],
            weight_s=self.weights[node.name],
            meta=meta,
            **meta.model_dump(),
        )
        self.graph.add_edge(parent, name)
        return name
