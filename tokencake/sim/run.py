"""Replay a trace against the engine model: the SDK's closed loop in simulated time.

Each app arrives at its ``arrival_s``; a node starts when the nodes it waits for are done; its
steps run in order: an LLM call is submitted to the engine and the node waits for it to finish
(the call announces the tool that follows, as the SDK's ``next_stall`` does); a tool call sends
``stall_begin``, lasts ``actual_s`` and sends ``stall_end``; a delay just passes. The engine steps
while it has work; when idle, time jumps to the next agent event or to when the KV core wants a
step (``Engine.next_wake``).

``SYSTEMS`` are the bench's systems the simulator models (``tokencake.bench.systems``): ``baseline``
(stock vLLM), ``ideal`` (stock vLLM with KV for everything), every KV policy in the extension
(``tokencake``, ``offload-all``, ``continuum``, ``infercept``, ``stock-connector``) and the ablations
of its Options.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tokencake.bench.systems import ALL_SYSTEMS, SystemSpec
from tokencake.serving.kvcore.core import KVCore
from tokencake.serving.options import Options
from tokencake.sim.engine import Engine, Request, Session
from tokencake.sim.kv import CoreFactory, summary
from tokencake.sim.profiles import HardwareProfile
from tokencake.sim.trace import AppTrace, DelayStep, LLMStep, NodeTrace, ToolStep, Trace

__all__ = ["SYSTEMS", "SimResult", "simulate"]

#: Shortest idle wait: the granularity at which an idle engine steps for the KV core.
IDLE_TICK_S = 0.01


#: The systems the simulator offers: the registry's (``tokencake.bench.systems``) ``simulated`` ones.
SYSTEMS: dict[str, SystemSpec] = {name: spec for name, spec in ALL_SYSTEMS.items() if spec.simulated}


@dataclass
class SimResult:
    system: str
    profile: str
    device_blocks: int
    host_blocks: int
    apps: int
    app_e2e_s: list[float]
    llm_calls: int
    makespan_s: float
    prompt_tokens: int
    computed_prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    preemptions: int
    ttft_mean_s: float
    extension: dict[str, Any] | None
    wall_s: float
    #: Mean seconds from arrival to first admission of critical-path and other agent requests
    #: (the connector's ``queue_wait_s.critical`` / ``.noncritical``).
    queue_wait_critical_mean_s: float = float("nan")
    queue_wait_noncritical_mean_s: float = float("nan")

    @property
    def e2e_mean_s(self) -> float:
        return statistics.fmean(self.app_e2e_s) if self.app_e2e_s else float("nan")

    def to_dict(self) -> dict[str, Any]:
        e = sorted(self.app_e2e_s)

        def q(p: float) -> float:
            return e[min(len(e) - 1, int(p * len(e)))] if e else float("nan")

        return {
            "system": self.system,
            "profile": self.profile,
            "device_blocks": self.device_blocks,
            "host_blocks": self.host_blocks,
            "apps": self.apps,
            "e2e_mean_s": self.e2e_mean_s,
            "e2e_p50_s": q(0.5),
            "e2e_p95_s": q(0.95),
            "llm_calls": self.llm_calls,
            "makespan_s": self.makespan_s,
            "throughput_calls_per_s": self.llm_calls / self.makespan_s if self.makespan_s > 0 else None,
            "prompt_tokens": self.prompt_tokens,
            "computed_prompt_tokens": self.computed_prompt_tokens,
            "device_hit_rate": self.device_hit_tokens / self.prompt_tokens if self.prompt_tokens else None,
            "host_hit_tokens": self.host_hit_tokens,
            "preemptions": self.preemptions,
            "ttft_mean_s": self.ttft_mean_s,
            "queue_wait_critical_mean_s": self.queue_wait_critical_mean_s,
            "queue_wait_noncritical_mean_s": self.queue_wait_noncritical_mean_s,
            "extension": self.extension,
            "wall_s": self.wall_s,
        }


def ideal_blocks(trace: Trace, block_size: int) -> int:
    """Device blocks that hold every session's final context at once (nothing is ever evicted)."""
    total = 0
    for app in trace.apps:
        for node in app.nodes:
            calls = [s for s in node.steps if isinstance(s, LLMStep)]
            if calls:
                last = calls[-1]
                total += -(-(last.prompt_tokens + last.output_tokens) // block_size) + 1
    return total + 8


def simulate(
    trace: Trace,
    profile: HardwareProfile,
    system: str | SystemSpec = "tokencake",
    *,
    device_blocks: int | None = None,
    host_blocks: int | None = None,
    max_sim_s: float = 1e7,
    core_factory: CoreFactory = KVCore,
) -> SimResult:
    """Replay ``trace`` on ``profile`` with ``system``; deterministic (no randomness in the model).

    ``core_factory`` builds the system's KV core (a benchmark passes a ``KVCore`` subclass to
    probe or vary it)."""
    started = time.perf_counter()
    spec = SYSTEMS[system] if isinstance(system, str) else system
    blocks = device_blocks or profile.device_blocks
    if spec.kv == "ideal":
        blocks = max(blocks, ideal_blocks(trace, profile.block_size))
    hosts = profile.host_blocks if host_blocks is None else host_blocks
    options = Options(policy=spec.policy, **spec.options) if spec.policy is not None else None
    engine = Engine(
        profile,
        device_blocks=blocks,
        options=options,
        host_blocks=hosts,
        scheduling=spec.engine_scheduling(),
        core_factory=core_factory,
    )
    loop = _Loop(engine, profile)
    for app in trace.apps:
        loop.at(app.arrival_s, lambda a=app: loop.start_app(a))
    loop.run(max_sim_s)
    ttft = [r.first_token_at - r.arrival for r in loop.requests if r.first_token_at is not None]
    waits: dict[bool, list[float]] = {True: [], False: []}
    for r in loop.requests:
        if r.admitted_at is not None:
            waits[r.priority == 0].append(r.admitted_at - r.arrival)
    return SimResult(
        system=spec.name,
        profile=profile.name,
        device_blocks=blocks,
        host_blocks=hosts if engine.core is not None else 0,
        apps=len(trace.apps),
        app_e2e_s=[loop.e2e[a.run_id] for a in trace.apps if a.run_id in loop.e2e],
        llm_calls=len(loop.requests),
        makespan_s=engine.now,
        prompt_tokens=engine.prompt_tokens,
        computed_prompt_tokens=engine.computed_prompt_tokens,
        device_hit_tokens=engine.local_hit_tokens,
        host_hit_tokens=engine.host_hit_tokens,
        preemptions=engine.preemptions,
        ttft_mean_s=statistics.fmean(ttft) if ttft else float("nan"),
        extension=summary(engine.core) if engine.core is not None else None,
        wall_s=time.perf_counter() - started,
        queue_wait_critical_mean_s=statistics.fmean(waits[True]) if waits[True] else float("nan"),
        queue_wait_noncritical_mean_s=statistics.fmean(waits[False]) if waits[False] else float("nan"),
    )


class _Loop:
    """Agent events on a heap; the engine steps between them."""

    def __init__(self, engine: Engine, profile: HardwareProfile) -> None:
        self.engine = engine
        self.profile = profile
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._rid = itertools.count()
        self._stall_ids = itertools.count()
        self.requests: list[Request] = []
        self._waiting_on: dict[Request, Iterator[None]] = {}
        self.e2e: dict[str, float] = {}

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def run(self, max_sim_s: float) -> None:
        engine = self.engine
        while True:
            while self._heap and self._heap[0][0] <= engine.now:
                t, _seq, fn = heapq.heappop(self._heap)
                self._event_time = t
                fn()
            if engine.has_work():
                for req in engine.step():
                    gen = self._waiting_on.pop(req)
                    self._event_time = engine.now
                    self._advance(gen)
            else:
                wake = engine.next_wake()
                nxt = self._heap[0][0] if self._heap else None
                if nxt is None and wake is None:
                    return
                target = min(t for t in (nxt, wake) if t is not None)
                # The connector wakes an idle engine for its own work; never stand still.
                engine.idle_until(max(target, engine.now + IDLE_TICK_S))
            if engine.now > max_sim_s:
                raise RuntimeError(f"simulation passed {max_sim_s} s of simulated time; is the trace sane?")

    # ------------------------------------------------------------------ apps and nodes
    def start_app(self, app: AppTrace) -> None:
        state = _AppState(app, self._event_time)
        for node in app.nodes:
            if not node.after:
                self._advance(self._node(state, node))

    def _node(self, state: _AppState, node: NodeTrace) -> Iterator[None]:
        session = Session(
            f"{state.app.run_id}:{node.name}",
            node.agent_type or node.name,
            self.profile.block_size,
            node.prefix_group,
            node.prefix_tokens,
            run_id=state.app.run_id,
            node=node.name,
        )
        steps = node.steps
        for i, step in enumerate(steps):
            if isinstance(step, DelayStep):
                self.at(self._event_time + step.seconds, self._resume_later())
                yield
            elif isinstance(step, LLMStep):
                nxt = steps[i + 1] if i + 1 < len(steps) else None
                announced = (nxt.tool, nxt.predicted_s) if isinstance(nxt, ToolStep) else None
                req = Request(
                    next(self._rid),
                    session,
                    step.prompt_tokens,
                    step.output_tokens,
                    self._event_time,
                    announced,
                    priority=node.priority,
                    run_id=state.app.run_id,
                )
                self.requests.append(req)
                self._pending_req = req
                self.engine.submit(req)
                yield
            elif isinstance(step, ToolStep):
                stall_id = f"st{next(self._stall_ids)}"
                self.engine.stall_begin(session, stall_id, step.tool, step.predicted_s)
                end = self._event_time + step.actual_s

                def finish_tool(sid: str = stall_id, tool: str = step.tool, d: float = step.actual_s) -> None:
                    self.engine.stall_end(session, sid, tool, d)

                self.at(end, self._resume_later(before=finish_tool))
                yield
        state.done.add(node.name)
        if len(state.done) == len(state.app.nodes):
            self.e2e[state.app.run_id] = self._event_time - state.started
            return
        for other in state.app.nodes:
            if other.name not in state.started_nodes and set(other.after) <= state.done:
                state.started_nodes.add(other.name)
                self._advance(self._node(state, other))

    def _resume_later(self, before: Callable[[], None] | None = None) -> Callable[[], None]:
        gen = self._current

        def resume() -> None:
            if before is not None:
                before()
            self._advance(gen)

        return resume

    def _advance(self, gen: Iterator[None]) -> None:
        prev = getattr(self, "_current", None)
        self._current = gen
        self._pending_req = None
        try:
            next(gen)
        except StopIteration:
            pass
        else:
            if self._pending_req is not None:
                self._waiting_on[self._pending_req] = gen
        finally:
            self._current = prev


@dataclass
class _AppState:
    app: AppTrace
    started: float
    done: set[str] = field(default_factory=set)
    started_nodes: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.started_nodes = {n.name for n in self.app.nodes if not n.after}
