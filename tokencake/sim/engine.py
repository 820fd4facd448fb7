"""The engine model: vLLM v1's step loop driving the connector's KV core, in vLLM's call order.

A step, as vLLM's ``EngineCore`` runs it:

1. ``schedule`` (:mod:`tokencake.sim.scheduler`): running requests, then waiting ones, with the
   core's admission hooks where vLLM calls the connector's; at its end the connector's
   ``build_connector_meta``: :meth:`KVCore.observe_step` (scheduled tokens, requests scheduled,
   requests preempted) then :meth:`KVCore.build_jobs` (the step's copy jobs);
2. the forward, which takes the hardware profile's time, plus the copies that run inside the step
   (:mod:`tokencake.sim.copies`);
3. ``update_from_output``: each finished request is handed to :meth:`KVCore.request_finished`
   before its blocks are freed (tail first), then the copies done by the step's end reach
   :meth:`KVCore.on_worker_meta`.

An engine with nothing to schedule steps only when the core wants it (its wake-up call after an
event, ``has_pending_work``, ``next_wake_at``) or a side-stream copy finishes: such a step
schedules nothing and lasts only as long as the copies it runs. Stall begin and end reach the core
as :class:`~tokencake.events.StallBegin` / :class:`~tokencake.events.StallEnd` through
``handle_event`` on the engine's clock, as the events listener delivers them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from tokencake.events import GraphMeta, NextStall, RequestMeta, StallBegin, StallEnd
from tokencake.serving.kvcore.core import KVCore
from tokencake.serving.options import Options
from tokencake.serving.spatial import SpatialScorer, admission_weights
from tokencake.sim.cache import BlockCache
from tokencake.sim.copies import CopyEngine
from tokencake.sim.device_pool import SimDevicePool
from tokencake.sim.kv import CoreFactory, build_core
from tokencake.sim.profiles import HardwareProfile
from tokencake.sim.scheduler import Scheduler, TokenCakeScheduler

__all__ = ["SCHEDULINGS", "Engine", "Request", "Session"]


@dataclass(eq=False)
class Session:
    """One agent's growing conversation; block ``i`` has a stable key (shared-prefix blocks: the group's)."""

    session_id: str
    agent_type: str
    block_size: int
    prefix_group: str | None = None
    prefix_tokens: int = 0
    #: Its app and node (the stall events name them; "" = a plain session, which sends none).
    run_id: str = ""
    node: str = ""
    _keys: list[bytes] = field(default_factory=list, init=False, repr=False)

    def key(self, i: int) -> bytes:
        """Block ``i``'s prefix key (bytes, like vLLM's block hashes: the host pool indexes them)."""
        if self.prefix_group is not None and (i + 1) * self.block_size <= self.prefix_tokens:
            return f"{self.prefix_group}\x00{i}".encode()
        return f"{self.session_id}\x00{i}".encode()

    def keys(self, n: int, start: int = 0) -> list[bytes]:
        """The keys of blocks ``start..n-1`` (made once, kept)."""
        keys = self._keys
        for i in range(len(keys), n):
            keys.append(self.key(i))
        return keys[start:n]


@dataclass(eq=False)
class Request:
    """One LLM call. It reads as the core's ``RequestView`` (the attributes vLLM's ``Request`` has)."""

    rid: int
    session: Session
    prompt_tokens: int
    output_tokens: int
    arrival: float
    #: The tool the agent calls after this reply (``next_stall``): (tool, hint seconds).
    next_tool: tuple[str, float] | None = None
    #: vLLM ``priority`` (lower first): 0 on the app's critical path, else its slack in seconds.
    priority: int = 0
    num_computed: int = 0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    cached_upto: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    #: Prompt tokens served by the device prefix cache / the host pool / computed, at admission.
    local_tokens: int = 0
    host_tokens: int = 0
    computed_prompt_tokens: int = 0
    #: Its app (the spatial score's app age; the metadata's ``run_id``); "" = a plain request.
    run_id: str = ""
    #: Its place in the waiting queue (lowest first), set when queued.
    queue_key: tuple[float, float, int] = (0.0, 0.0, 0)

    @property
    def total_tokens(self) -> int:
        """Tokens whose KV the request needs now (the prompt plus what it generated so far)."""
        return self.prompt_tokens + self.generated

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.total_tokens - (1 if self.generated else 0)

    @cached_property
    def meta(self) -> RequestMeta | None:
        """What the SDK sends with it (None for a plain request): its session, app and node, the
        announced tool, and its place in the DAG as a trace knows it — on the critical path when
        its priority is 0, else its priority as seconds of slack."""
        if not self.run_id:
            return None
        nxt = None
        if self.next_tool is not None:
            nxt = NextStall(tool=self.next_tool[0], predicted_s=self.next_tool[1] or None)
        return RequestMeta(
            session_id=self.session.session_id,
            run_id=self.run_id,
            node=self.session.node,
            agent_type=self.session.agent_type,
            graph=GraphMeta(on_critical_path=self.priority == 0, slack_s=float(self.priority)),
            next_stall=nxt,
        )

    # ---- RequestView
    @property
    def request_id(self) -> str:
        return str(self.rid)

    @property
    def num_tokens(self) -> int:
        return self.total_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.generated

    @property
    def num_computed_tokens(self) -> int:
        return self.num_computed

    @property
    def block_hashes(self) -> list[bytes]:
        """The session's keys of the full blocks of ``num_tokens``."""
        return self.session.keys(self.total_tokens // self.session.block_size)

    @cached_property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        meta = self.meta
        return None if meta is None else {"tokencake": meta.model_dump()}


#: Admission orders the engine models (``Engine(scheduling=...)``).
SCHEDULINGS: tuple[str, ...] = ("fcfs", "priority", "spatial")


class Engine:
    def __init__(
        self,
        profile: HardwareProfile,
        *,
        device_blocks: int | None = None,
        options: Options | None = None,
        host_blocks: int | None = None,
        scheduling: str = "fcfs",
        core_factory: CoreFactory = KVCore,
        copies: CopyEngine | None = None,
    ) -> None:
        """``options``: the connector's (None: stock vLLM, no connector). ``scheduling``: ``fcfs``
        (vLLM's default), ``priority`` (``--scheduling-policy priority``: the queue by
        (priority, arrival), the victim the lowest priority) or ``spatial`` (TokenCake's
        ``--scheduler-cls``: the queue by the spatial score, the victim as under ``priority``,
        and the core's critical-last eviction side unless ``Options.critical_last`` is off)."""
        if scheduling not in SCHEDULINGS:
            raise ValueError(f"scheduling must be one of {', '.join(SCHEDULINGS)}, got {scheduling!r}")
        self.scheduling = scheduling
        self.profile = profile
        self.block_size = profile.block_size
        self.cache = BlockCache(device_blocks or profile.device_blocks)
        self.now = 0.0
        self.core: KVCore | None = None
        if options is not None:
            self.core = build_core(
                profile,
                options,
                host_blocks=profile.host_blocks if host_blocks is None else host_blocks,
                clock=lambda: self.now,
                critical_last=scheduling == "spatial" and options.critical_last,
                factory=core_factory,
            )
            self.core.bind_pool(SimDevicePool(self.cache))
            self.core.set_wake(self._wake)
        self.copies = copies if copies is not None else CopyEngine(profile)
        core = self.core
        # The admission order is the KV policy's (Continuum's differs), as the connector's.
        admission = (core.opts.admission or core.policy.admission) if core is not None else None
        self.scorer = SpatialScorer(admission_weights(admission))
        if scheduling == "spatial":
            self.scheduler: Scheduler = TokenCakeScheduler(
                profile, self.cache, core, scorer=self.scorer, clock=lambda: self.now
            )
        else:
            self.scheduler = Scheduler(profile, self.cache, core, policy=scheduling)
        self.steps = 0
        self.busy_s = 0.0
        self.prompt_tokens = 0
        #: The core asked for a step (an event arrived, or work is pending after the last step).
        self._woken = False

    # ------------------------------------------------------------------ what the run reads
    @property
    def waiting(self) -> Any:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def computed_prompt_tokens(self) -> int:
        return self.scheduler.computed_prompt_tokens

    @property
    def local_hit_tokens(self) -> int:
        return self.scheduler.local_hit_tokens

    @property
    def host_hit_tokens(self) -> int:
        return self.scheduler.host_hit_tokens

    # ------------------------------------------------------------------ requests and events
    def submit(self, req: Request) -> None:
        """vLLM's ``add_request``: the request joins the waiting queue, then the connector sees it."""
        self.prompt_tokens += req.prompt_tokens
        self.scheduler.enqueue(req)
        if self.core is not None:
            self.core.on_new_request(req)

    def stall_begin(self, session: Session, stall_id: str, tool: str, hint_s: float) -> None:
        """The session's tool call starts (``stall_begin``; plain sessions send none)."""
        if self.core is None or not session.run_id:
            return
        self.core.handle_event(
            StallBegin(
                stall_id=stall_id,
                session_id=session.session_id,
                run_id=session.run_id,
                node=session.node or session.session_id,
                agent_type=session.agent_type,
                tool=tool,
                predicted_s=hint_s or None,
                ts=self.now,
            )
        )

    def stall_end(self, session: Session, stall_id: str, tool: str, duration_s: float) -> None:
        """The tool call returned (``stall_end``)."""
        if self.core is None or not session.run_id:
            return
        self.core.handle_event(
            StallEnd(
                stall_id=stall_id,
                session_id=session.session_id,
                run_id=session.run_id,
                node=session.node or session.session_id,
                tool=tool,
                duration_s=duration_s,
                ts=self.now,
            )
        )

    def _wake(self) -> None:
        self._woken = True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def next_wake(self) -> float | None:
        """When an engine with nothing to schedule next steps (None: not until a request comes):
        at once when the core asked, at the core's ``next_wake_at``, or when a copy finishes."""
        if self.core is None:
            return None
        if self._woken:
            return self.now
        times = [t for t in (self.core.next_wake_at(), self.copies.next_done_at()) if t is not None]
        return max(min(times), self.now) if times else None

    def idle_until(self, t: float) -> None:
        """Nothing to compute until ``t``: time passes, then the engine steps for the core."""
        self.now = max(self.now, t)
        if self.core is not None:
            self.step()

    def reset_prefix_cache(self) -> bool:
        """The scheduler's prefix-cache reset (the connector is told)."""
        return self.scheduler.reset_prefix_cache(reset_connector=True)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Request]:
        """Schedule, run one forward, and return the requests that finished in it."""
        now, core = self.now, self.core
        self._woken = False
        plan = self.scheduler.schedule(now)
        jobs = []
        if core is not None:
            preempted = [r.request_id for r in plan.preempted]
            core.observe_step(plan.tokens, num_running=len(plan.scheduled), preempted=preempted)
            jobs = core.build_jobs()
        dt = self.copies.submit(jobs, now)
        if plan.scheduled or self.has_work():
            compute = self._step_time(plan.scheduled)
            if self.copies.side_busy(now):
                compute *= 1 + self.profile.copy_compute_slowdown  # a copy beside it shares HBM
            dt += compute
            self.steps += 1
            self.busy_s += dt
        self.now = now + dt
        finished = []
        for req, n in plan.scheduled:
            req.num_computed += n
            if req.num_computed >= req.total_tokens - (1 if req.generated else 0):
                # The step that completes the prefill samples the first token; each decode step one.
                req.generated += 1
                if req.first_token_at is None:
                    req.first_token_at = self.now
                if req.generated >= req.output_tokens:
                    finished.append(req)
        self._update_from_output(finished)
        return finished

    def _update_from_output(self, finished: list[Request]) -> None:
        """vLLM's ``update_from_output``: finished requests leave (the connector sees each before
        its blocks are freed, the tail first), then the copies done by now are reported."""
        core = self.core
        for req in finished:
            req.finished_at = self.now
            self.running.remove(req)
            if core is not None:
                core.request_finished(req)
            self.cache.release(list(reversed(req.blocks)))
            req.blocks = []
        if core is None:
            return
        report = self.copies.report(self.now)
        if report is not None:
            core.on_worker_meta(report)
        # Work planned with nothing left to copy (an early save at a finish, a due prefetch): an
        # idle vLLM engine steps again at once for it (``has_pending_push_work``).
        if not self.has_work() and not self.copies.busy and core.has_pending_work():
            self._woken = True

    def _step_time(self, scheduled: list[tuple[Request, int]]) -> float:
        p = self.profile
        if not scheduled:
            return p.step_s
        prefill = ctx = decode = decode_ctx = 0
        for req, n in scheduled:
            if req.generated and n == 1 and req.num_computed >= req.total_tokens - 1:
                decode += 1
                decode_ctx += req.num_computed
            else:
                prefill += n
                ctx += n * (req.num_computed + n // 2)
        return p.step_time(prefill, ctx, decode, decode_ctx)
