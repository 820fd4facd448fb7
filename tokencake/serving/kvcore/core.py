"""Scheduler-side half of the connector: the temporal policy acting on vLLM's block pool.

Everything here runs on vLLM's engine thread (inside EngineCore), except :meth:`handle_event`
and :meth:`stats_snapshot`, which the events listener thread calls. The two threads share only
thread-safe objects (``SessionTracker``, ``Stats``, the forecaster) and a wake-up callback; all
block-pool and host-pool mutation happens on the engine thread, in the hooks vLLM calls:

``request_finished``
    remember the session's latest block hashes (prompt + output, full blocks). When the request
    announced its next tool call (``next_stall``) and the gate says the stall will need it, start
    saving the blocks right here (pinned), so the save never races their eviction.
``build_connector_meta`` (every step, also empty ones)
    drain stall transitions; at ``stall_begin`` ask the gate and plan the offload (pin the
    cached device blocks, reserve host slots); re-ask retryable decisions while the stall
    lasts; start the prefetches the ``PrefetchPlanner`` says are due (allocate device blocks,
    within the free blocks that waiting requests do not need); expire stalls; emit the step's
    copy jobs for the workers.
``update_connector_output``
    finished copies come back from the workers: commit offloaded blocks to the host index,
    register prefetched blocks in the device prefix cache, release every pin. Once a stalled
    session's chain is safely on host, its idle device blocks move to the *front* of vLLM's
    eviction queue (latest predicted return first), and back to the end when its prefetch falls
    due or the tool returns.
``get_num_new_matched_tokens`` / ``update_state_after_alloc``
    demand load: count host-pool hits past the device prefix, map them to the blocks vLLM
    allocated, and plan a synchronous host → device load. A request whose prefetch is still
    being copied waits one step for it instead of loading the same blocks twice.
``reset_cache``
    vLLM reset its prefix cache (weights changed): drop every host copy, ignore copies in flight.

Rules that keep vLLM correct: every device block we pin or allocate is released exactly once
(``_Job.release``); offloads are copied after the step's forward (the worker runs them in
``wait_for_save``: a block hashed this step holds its KV only then); a block is published in
the prefix cache only after its copy is confirmed, and only when no other block serves its hash;
a prefetch only brings back blocks that extend an unbroken chain from block 0; a failed load is
reported so vLLM recomputes, and its blocks leave the prefix cache; nothing from before a
``reset_cache`` is committed or published.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from pydantic import ValidationError

from tokencake.events import META_KEY, EventAck, NextStall, RequestMeta, StallBegin, StallEnd
from tokencake.serving.forecast import DurationForecaster
from tokencake.serving.gate import GateInput, OffloadGate, TransferModel, remaining_s
from tokencake.serving.host_pool import HostPool, HostPoolExhausted, preemption_victims
from tokencake.serving.kvcore.ports import DeviceBlock as KVCacheBlock
from tokencake.serving.kvcore.ports import DevicePool, RequestView
from tokencake.serving.kvcore.wire import CopyJob, CopyReport, JobKind
from tokencake.serving.options import Options
from tokencake.serving.policies import KVPolicy, Plan, PolicyView, make_policy
from tokencake.serving.prefetch import PrefetchPlanner, kept_room, miss_reason, stall_expiry_s
from tokencake.serving.profile import PrefillProfile
from tokencake.serving.sessions import BlockUsers, ByteLRU, SessionTracker, StallTransition, hashes_nbytes
from tokencake.serving.spatial import CRITICAL_WATCH, demote_rank, reserved_sessions
from tokencake.serving.stats import Stats

log = logging.getLogger("vllm.tokencake")

#: How often an otherwise idle engine steps while copies given up after ``job_timeout_s`` are
#: still out (their late reports release device blocks and host slots).
ABANDONED_POLL_S = 1.0
#: Sessions whose last request was on the critical path (their stalls are demoted last).
CRITICAL_SESSIONS = 4096
#: Readiness of a session's blocks when its next request arrives (``readiness.*`` counters).
READINESS = ("prefetched", "not_needed", "loading", "missed")


@dataclass
class _Job:
    """A copy in flight and everything it holds (released exactly once)."""

    job_id: int
    kind: JobKind
    hashes: list[bytes]
    #: Position of each block in its request's chain (for the prefix-cache token count).
    positions: list[int]
    device_blocks: list[KVCacheBlock]
    slots: list[int]
    issued_at: float
    stall_id: str | None = None
    req_id: str | None = None
    session_id: str | None = None
    #: ``reset_cache`` count when planned: a job from before a reset commits/publishes nothing.
    generation: int = 0
    #: True when the device blocks hold a reference taken by us (offload pin, prefetch allocation).
    device_owned: bool = False
    reports: int = 0
    released: bool = False
    #: False once any worker reported the copy failed.
    ok: bool = True
    #: Timed out: nobody waits for it any more, but its pins stay until every worker reported
    #: (a copy may still be writing into those device blocks / host slots).
    abandoned: bool = False
    #: A demand load's request blocks from its first loaded one on, as allocated with it: if the
    #: load fails, these hold bad KV (loaded, or computed this step from loaded KV) until the
    #: request recomputes them — vLLM keeps their hashes meanwhile (recompute policy).
    downstream: tuple[int, tuple[int, ...]] = (0, ())  # (first position, block ids from it on)

    @property
    def owner(self) -> str:
        return self.owner_of(self.job_id)

    @staticmethod
    def owner_of(job_id: int) -> str:
        """The host-pool owner id of job ``job_id`` (its slots are pinned under it)."""
        return f"job:{job_id}"

    def to_wire(self) -> CopyJob:
        return CopyJob(
            self.job_id, self.kind, [b.block_id for b in self.device_blocks], list(self.slots), self.req_id
        )


@dataclass
class _Stall:
    """The engine thread's view of one active (or just ended) stall."""

    stall_id: str
    session_id: str
    agent_type: str
    tool: str
    begin_at: float
    predicted_s: float
    hashes: tuple[bytes, ...]
    #: False when the session never finished a request here (nothing to offload).
    known: bool = True
    decision: str | None = None
    offloaded: bool = False
    next_eval: float = 0.0
    #: The current re-ask interval of a retryable "no" (backs off while nothing waits).
    retry_s: float = 0.0
    ended_at: float | None = None
    #: Seconds a host → device copy of the chain needs ahead of the return (transfer + margin).
    lead_s: float = 0.0
    #: The prefetch copy in flight (its timing and state live in the ``PrefetchPlanner``).
    prefetch_job: int | None = None
    #: Blocks published in the device prefix cache by prefetches of this stall.
    prefetched: list[bytes] = field(default_factory=list)
    #: Headroom refusals; a deferred prefetch waits for the next regular step.
    deferred: int = 0
    #: The last upload brought only the chain's head (budget): the rest is topped up when room frees.
    topup: bool = False
    accounted: bool = False
    #: A request of the session was admitted after the stall began (nothing left to hold for).
    resumed: bool = False
    #: The policy's plan says the device copies go first in the eviction queue once on host.
    evict_first: bool = True
    #: The session's last request was on its app's critical path: among demoted chains, evicted last.
    critical: bool = False
    #: How much of the chain was still on device or host when the stall was first decided (None:
    #: not decided yet): what was lost before then no decision could have saved.
    chain_at_decision: int | None = None
    #: What the session's announcing request decided when it finished (``early_save.decision``;
    #: None: no at-finish decision): the cause behind a chain cut before the stall's first decision.
    finish_decision: str | None = None
    #: Room kept for its return (``return_reserve``): from its upload's due time to the late end
    #: of its likely return (the plan's ``due_at`` / ``late_at``; inf: never)...
    reserve_from: float = math.inf
    reserve_until: float = math.inf
    #: ...and the blocks of its chain that need room, counted once when that window opens (the
    #: run that could come back, less the blocks others reference); its own hold is subtracted.
    reserve_blocks: int | None = None

    @property
    def returns_at(self) -> float:
        """Predicted end of the tool call (server clock)."""
        return self.begin_at + self.predicted_s


class _Watch(NamedTuple):
    """A critical-path session's idle chain, watched until its next request is admitted."""

    hashes: tuple[bytes, ...]
    #: Until when it is expected back even with no stall or request seen (its finish + the
    #: announced tool's stall expiry).
    until: float


@dataclass
class _Keep:
    """Device blocks held for an idle session (one reference each, released once).

    ``kind`` is ``keep`` (a policy's plan) or ``hold`` (a prefetched chain waiting for its
    request). When room is needed the hold with the latest ``rank`` (predicted return) goes first;
    with the spatial scheduler on, non-critical sessions' holds before critical-path ones'.
    """

    session_id: str
    blocks: list[KVCacheBlock]
    until: float
    since: float
    rank: float = 0.0
    kind: str = "keep"
    #: The session's last request was on its app's critical path.
    critical: bool = False

    @property
    def releasable(self) -> int:
        """Blocks only this hold keeps on device (releasing it frees exactly these)."""
        return sum(b.ref_cnt == 1 for b in self.blocks)


@dataclass
class _ReqInfo:
    """What the connector keeps about a request that carries TokenCake metadata."""

    session_id: str
    agent_type: str
    next_stall: NextStall | None = None
    #: The node is on its app's critical path (the SDK's graph metadata).
    critical: bool = False
    #: The client sends no stall events for this session: derive them (``RequestMeta.stall_events``).
    derive_stalls: bool = False
    run_id: str = ""
    node: str = ""
    #: A prefetch of this session was being copied when the request arrived (readiness: ``loading``).
    arrived_while_loading: bool = False
    #: When the request arrived: could the session's missing chain blocks have been uploaded then
    #: under the prefetch budget rule (None: unknown)? Taken at arrival, not when vLLM first asks
    #: for its prefix — under a long queue that is much later, and the device fuller.
    room_at_arrival: bool | None = None
    #: The node's slack in its app's DAG (seconds it can start late without delaying the app).
    slack_s: float = 0.0
    #: It waited at least one step for the critical reserve (``_spare_critical_chains``).
    reserve_waited: bool = False
    #: Its admission waited for a prefetch of its session in flight (``demand_load.waited_for_prefetch``).
    waited_for_prefetch: bool = False
    #: How many leading blocks of the session's last chain that this prompt repeats were cached on
    #: device when the request arrived (readiness; None: not known at arrival).
    device_blocks_at_arrival: int | None = None
    #: Why its session's chain would be missed, from the prefetch plan as it stood at arrival
    #: (``readiness.missed_why``; the plan moves on while the request queues).
    missed_why_at_arrival: str | None = None


def _finish_owner(session_id: str) -> str:
    """Host-pool owner of an at-finish save's copies until the session's stall begins."""
    return f"finish:{session_id}"


_STALL_OWNER = "stall:"


def stall_owner(stall_id: str) -> str:
    """Host-pool owner of a stall's copies.

    Stall ids come from clients, so they get their own namespace: a stall named ``job:7`` must
    not own (and on release unpin) the slots copy job 7 is still reading.
    """
    return f"{_STALL_OWNER}{stall_id}"


def _extra_bool(extra: dict[str, Any], name: str, default: bool) -> bool:
    value = extra.get(name, default)
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


def request_meta(request: RequestView) -> RequestMeta | None:
    """``kv_transfer_params.tokencake`` of a request, or None (absent or invalid: plain vLLM)."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict):
        return None
    raw = params.get(META_KEY)
    if not isinstance(raw, dict):
        return None
    try:
        return RequestMeta.model_validate(raw)
    except ValidationError:
        return None


class KVCore:
    """The KV mechanism's engine-thread state; see the module docstring."""

    #: Among demoted chains, critical-path sessions' are evicted last. The spatial scheduler
    #: (``scheduler.py``) turns this on when it takes over admission; off, the order is by
    #: predicted return only, as measured for the default server.
    critical_last: bool = False
    #: The decision recorder (off: None): set to a list and every decision is appended to it in
    #: order as ``{"t": clock, "what": ..., <fields>}`` — copy jobs planned, holds and their
    #: release, admission waits, completions, commits, publishes, suspect marks, timeouts, resets.
    #: Tests compare the backends' logs with it (``tests/sim/test_parity.py``).
    decisions: list[dict[str, Any]] | None = None

    def __init__(
        self,
        *,
        block_size: int,
        block_bytes: int,
        num_host_blocks: int,
        num_workers: int = 1,
        device_is_cuda: bool = False,
        max_step_tokens: int = 2048,
        lookahead_tokens: int = 0,
        watermark: float = 0.0,
        options: Options | None = None,
        clock: Callable[[], float] = time.monotonic,
        profile: PrefillProfile | None = None,
        private_api: str | None = None,
    ) -> None:
        """``private_api``: why the pool's eviction-order and publish operations cannot be used
        (None: they can); without them prefetch and eviction reordering are off."""
        self.opts = options or Options()
        #: One step may schedule this many new tokens (vLLM's max_num_batched_tokens).
        self.max_step_tokens = max(1, int(max_step_tokens))
        #: vLLM's admission also wants slots for these (speculative tokens) and, while requests
        #: run, this share of the device left free (``--watermark``): ``_make_room`` counts both.
        self.lookahead_tokens = max(0, int(lookahead_tokens))
        self.watermark = max(0.0, float(watermark))
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.num_workers = max(1, num_workers)
        self.clock = clock
        self.host = HostPool(num_host_blocks)
        self.stats = Stats()
        self.forecaster = DurationForecaster()
        self.profile = profile if profile is not None else PrefillProfile(device_is_cuda=device_is_cuda)
        seeded = self.profile.bandwidths or {}
        self.transfer = TransferModel.for_device(
            device_is_cuda, **{f"{k}_bytes_per_s": v for k, v in seeded.items()}
        )
        self.gate = OffloadGate(
            self.transfer,
            enabled=self.opts.offload,
            usage_threshold=self.opts.usage_threshold,
            min_waiting=self.opts.min_waiting,
        )
        self.policy: KVPolicy = make_policy(self.opts.policy, gate=self.gate, seed=self.opts.policy_seed)
        self.sessions = SessionTracker(clock=clock)
        self.planner = PrefetchPlanner(
            clock=clock,
            safety_margin_s=self.opts.prefetch_margin_s,
            expiry_factor=self.opts.expiry_factor,
            expiry_min_s=self.opts.expiry_min_s,
            expiry_max_s=self.opts.expiry_max_s,
            unused_after_s=self.opts.end_grace_s,
            return_quantile=self.opts.prefetch_quantile,
            prior_ratio=self.opts.prefetch_prior_ratio,
        )
        self.pool: DevicePool | None = None
        private = private_api
        self.private_ok = private is None
        if private is not None and (self.opts.prefetch or self.opts.demote):
            log.warning(
                "TokenCake: predictive prefetch and eviction reordering disabled (%s); demand load stays on",
                private,
            )
        self._wake: Callable[[], None] | None = None
        self._lock = threading.Lock()  # guards _wake_at (listener/timer threads vs engine thread)
        self._wake_at: float | None = None
        #: While given-up copies are out, when the engine next steps so the worker polls them.
        self._poll_abandoned_at: float | None = None
        self._next_job = 1
        self._generation = 0
        self._jobs: dict[int, _Job] = {}
        self._outbox: list[CopyJob] = []
        self._stalls: dict[str, _Stall] = {}
        #: Block hash -> the live stalls whose chain holds it (a shared prompt: several).
        self._stall_users = BlockUsers()
        self._ended: dict[str, _Stall] = {}
        #: Last ended/expired stall per session (to account the session's next request).
        self._last_stall: ByteLRU[str, _Stall] = ByteLRU(max_items=4096, max_bytes=64 << 20)
        self._next_sweep = 0.0
        #: Why the workers cannot copy (reported by them), or None.
        self.copies_disabled: str | None = None
        #: session id -> its active stall's id.
        self._session_stall: dict[str, str] = {}
        #: req_id -> what we know of requests carrying TokenCake metadata.
        self._reqs: dict[str, _ReqInfo] = {}
        #: req_id -> (first block, hashes, slots) from the last get_num_new_matched_tokens.
        self._pending_load: dict[str, tuple[int, list[bytes], list[int]]] = {}
        #: req_id -> device prefix-cache hit (tokens) of a session request, for accounting.
        self._local_hit: dict[str, int] = {}
        #: request id -> where its prompt KV came from at admission (until it finishes).
        self._provenance: dict[str, dict[str, int]] = {}
        #: session id -> tokens of its copies (offload, prefetch) that failed since its last
        #: admission; reported with the next request's provenance (a faulty copy's trace).
        self._failed_copies: ByteLRU[str, int] = ByteLRU(max_items=4096, max_bytes=1 << 20)
        #: device block id -> the hash whose KV a host copy (prefetch or load) wrote into it. A hit
        #: on such a block serves copied KV, whichever session's copy put it there (provenance).
        self._copied: dict[int, bytes] = {}
        #: Device block id -> the first job id planned after a failed load left bad KV in it (and
        #: took it out of the prefix cache, ``_mark_suspect``): a save of it planned before that
        #: is not committed. Dropped once no copy planned before the mark is in flight.
        self._suspect: dict[int, int] = {}
        #: Requests not yet admitted -> blocks their prompt needs (the queue's KV demand).
        self._waiting: dict[str, int] = {}
        #: Admitted requests not finished yet (a preempted one goes back to ``_waiting``).
        self._admitted: dict[str, RequestView] = {}
        #: Resumed turns (a session's request after its tool call) waiting for their first token:
        #: request and arrival, for the ``next_turn.ttft_s`` histogram.
        self._first_token: dict[str, tuple[RequestView, float]] = {}
        self._was_waiting = False  # whether requests waited at the last step (re-ask on change)
        #: Idle chains of critical-path sessions (their request finished; the next one is not
        #: admitted yet), and their cached-block counts before a non-critical admission.
        self._critical_idle: ByteLRU[str, _Watch] = ByteLRU(
            max_items=CRITICAL_WATCH, max_bytes=16 << 20, on_evict=self._forget_critical_hashes
        )
        #: Block hash → the watched critical sessions whose idle chain has it (the index a
        #: non-critical admission's eviction window is checked against, O(window)).
        self._critical_owners: dict[bytes, set[str]] = {}
        self._critical_before: dict[str, frozenset[bytes]] | None = None
        #: Sessions whose latest finished request was on the critical path (``_Stall.critical``).
        self._critical_sessions: ByteLRU[str, bool] = ByteLRU(max_items=CRITICAL_SESSIONS, max_bytes=1 << 20)
        #: Sessions whose client sends no stall events: the stall derived from their last request.
        self._derived: ByteLRU[str, tuple[StallBegin, float]] = ByteLRU(max_items=4096, max_bytes=1 << 20)
        #: Block hash -> offload job copying it (the host copy exists once that job commits).
        self._filling: dict[bytes, int] = {}
        #: Offloaded stalls whose idle device blocks are at the front of the eviction queue.
        self._demoted: set[str] = set()
        #: Session id -> its prefetch job being copied.
        self._prefetching: dict[str, int] = {}
        #: Stalls whose upload brought only the chain's head (``_Stall.topup``), in upload order.
        self._topups: dict[str, None] = {}
        #: (time, tokens scheduled) of recent steps: the allocation rate behind the eviction risk.
        self._steps: deque[tuple[float, int]] = deque()
        #: Seconds between consecutive busy steps (the engine acts on a copy only at a step boundary).
        self._step_gaps: deque[float] = deque(maxlen=64)
        self._last_step: tuple[float, int] | None = None
        #: Requests the last step scheduled (each may need a new block for its next token).
        self._running = 0
        #: Holds yielded to a running request this scheduling pass (``free_for_running``): the
        #: pass admits no waiting request, so the freed blocks are the running request's.
        self._running_short = False
        #: The last pass ended that way: its step spares no block for a prefetch (``_keep_free``),
        #: or the blocks just given back would be taken again before the running request's turn.
        self._short_pass = False
        self._last_risk: float | None = None
        self._usa_req: str | None = None
        self._usa_first = 0
        #: Session id -> device blocks a policy keeps for it (``keep``).
        self._kept: dict[str, _Keep] = {}
        #: Room kept ahead of returns (``Options.return_reserve``; "auto": on where copies run on
        #: CUDA side streams beside the forward) and, per step, session -> blocks kept for it.
        self.reserves_returns = self.opts.reserves_returns(copies_beside_compute=device_is_cuda)
        self._returning: dict[str, int] = {}
        #: Sessions whose at-finish save committed before their stall began: their host copies are
        #: pinned (owner ``finish:<session>``) until the stall pins them, or this deadline.
        self._finish_pins: dict[str, float] = {}
        #: Session → its latest at-finish decision, until its stall begins (``_Stall.finish_decision``).
        self._finish_decision: ByteLRU[str, str] = ByteLRU(max_items=CRITICAL_SESSIONS, max_bytes=1 << 20)
        #: Request id -> arrival time (the queueing delay policies learn from).
        self._arrival: dict[str, float] = {}
        #: Request id -> when vLLM's admission first looked at it (the head of the queue), until
        #: admitted: the critical reserve's clock with ``critical_reserve_wait_from = "head"``.
        self._first_look: dict[str, float] = {}
        self.stats.register("host_pool", self.host.stats)
        self.stats.register("sessions", self.sessions.stats)
        self.stats.register("forecast", self.forecaster.stats)
        self.stats.register("gate", self.gate.stats)
        self.stats.register("prefetch_plan", self.planner.stats)
        self.stats.register("policy", self.policy.stats)
        self.stats.register("profile", self.profile.stats)
        self.stats.register("engine", self._engine_stats)
        self.stats.register("config", self._config_stats)

    # ------------------------------------------------------------ decision recorder
    def _note(self, what: str, **fields: Any) -> None:
        """Record one decision (callers check ``decisions is not None`` first: nothing when off)."""
        assert self.decisions is not None
        self.decisions.append({"t": self.clock(), "what": what, **fields})

    # ------------------------------------------------------------ wiring
    def bind_pool(self, pool: DevicePool) -> None:
        self.pool = pool

    def set_wake(self, wake: Callable[[], None] | None) -> None:
        """A thread-safe callback that makes an idle engine run one step (None: none available)."""
        self._wake = wake

    def _poke(self) -> None:
        if self._wake is not None:
            try:
                self._wake()
            except Exception:
                self.stats.inc("errors.wake")

    # -------------------------------------------------- listener thread
    def handle_event(self, event: StallBegin | StallEnd) -> EventAck:
        """Record one event (bookkeeping only) and wake the engine; called off the engine thread."""
        ack = self.sessions.apply(event)
        self.stats.inc(f"events.{event.type}")
        self.stats.inc(f"acks.{ack.status if ack.ok else ack.reason}")
        if ack.ok and ack.status == "recorded":
            self._poke()
        return ack

    def stats_snapshot(self) -> dict[str, Any]:
        return self.stats.snapshot()

    def next_wake_at(self) -> float | None:
        """Monotonic time when the engine must step for a timed prefetch (for the waker thread)."""
        with self._lock:
            return self._wake_at

    # -------------------------------------------------- engine thread
    def has_pending_work(self) -> bool:
        """True while copies are in flight, transitions wait, or a prefetch is due now."""
        live = any(not j.abandoned for j in self._jobs.values())
        if live or self._outbox or self.sessions.pending_transitions():
            return True
        if self._poll_abandoned_at is not None and self.clock() >= self._poll_abandoned_at:
            return True  # a given-up copy's late report releases its pins: poll for it now and then
        if not self.prefetch_enabled:
            return False
        # A prefetch deferred for headroom is retried at the next regular step; it must not keep an
        # otherwise idle engine spinning.
        for sid in self.planner.due(self.clock()):
            stall = self._stall(sid)
            if stall is not None and not stall.deferred and not self._offload_pending(stall):
                return True
        return False

    @property
    def prefetch_enabled(self) -> bool:
        return self.opts.prefetch and self.private_ok

    @property
    def demote_enabled(self) -> bool:
        return self.opts.demote and self.private_ok

    def holds_kv(self, session_id: str) -> bool:
        """Whether device blocks are held for this idle session (a policy's keep or a prefetch)."""
        return session_id in self._kept

    def saved_kv(self, session_id: str) -> bool:
        """Whether at least half of the session's latest chain is on host from its head: its next
        request resumes with a load (the spatial score's ``saved_s``). Pinned or not: copies an
        offloaded stall pins stay pinned while the request waits; others are the LRU's."""
        stall = self._active_stall(session_id) or self._last_stall.get(session_id)
        return stall is not None and self.host.saves_most_of(stall.hashes)

    def _stall(self, stall_id: str) -> _Stall | None:
        return self._stalls.get(stall_id) or self._ended.get(stall_id)

    def _offload_pending(self, stall: _Stall) -> bool:
        """Whether a block of the stall's chain is still being copied to the host."""
        return bool(self._filling) and any(h in self._filling for h in stall.hashes)

    def on_new_request(self, request: RequestView) -> None:
        meta = request_meta(request)
        if meta is not None:
            self._reqs[request.request_id] = _ReqInfo(
                meta.session_id,
                meta.agent_type or meta.node,
                meta.next_stall,
                meta.graph.on_critical_path,
                derive_stalls=not meta.stall_events,
                run_id=meta.run_id,
                node=meta.node,
                slack_s=max(float(meta.graph.slack_s), 0.0),
            )
            self.stats.inc("requests.with_meta")
            if not meta.stall_events:
                self._end_derived_stall(meta.session_id)
            elif meta.session_id in self._session_stall:
                self._drain(self.clock())  # its end, if delivered, is usually still queued
                self._end_stalls_the_request_outlived(meta.session_id)
            # Its stalls' host copies are what this request loads next: keep them pinned while
            # it waits for admission, however long the queue (PrefetchPlanner.on_waiting).
            self.planner.on_waiting(meta.session_id, now=self.clock())
            # Readiness is judged at arrival (the user's wait starts here), not at vLLM's first ask.
            info = self._reqs[request.request_id]
            info.arrived_while_loading = self._jobs.get(self._prefetching.get(meta.session_id, 0)) is not None
            info.room_at_arrival = self._room_for_chain(meta.session_id, request.request_id)
            info.device_blocks_at_arrival = self._repeated_chain_on_device(meta.session_id, request)
            last = self._last_stall.get(meta.session_id)
            if last is not None and not last.accounted:
                info.missed_why_at_arrival = miss_reason(
                    self.planner.get(last.stall_id),
                    room_at_arrival=info.room_at_arrival,
                    deferred=last.deferred,
                )
        self._waiting[request.request_id] = -(-int(request.num_tokens) // self.block_size)
        self._arrival[request.request_id] = self.clock()

    def request_finished(self, request: RequestView) -> dict[str, Any] | None:
        """The request finished (its blocks are still held): early save, stall bookkeeping.

        Returns where its prompt KV came from (``_record_provenance``), None if never admitted.
        """
        req_id = request.request_id
        provenance = self._provenance.pop(req_id, None)
        self._finish(request)
        return provenance

    def _finish(self, request: RequestView) -> None:
        req_id = request.request_id
        self._waiting.pop(req_id, None)
        self._admitted.pop(req_id, None)
        if self._first_token:
            self._watch_first_tokens(self.clock(), finished=req_id)
        never_admitted = self._arrival.pop(req_id, None) is not None
        self._first_look.pop(req_id, None)
        self._pending_load.pop(req_id, None)
        self._local_hit.pop(req_id, None)
        info = self._reqs.pop(req_id, None)
        if info is not None and never_admitted:  # aborted while queued: its host copies wait no more
            self.planner.on_waiting_cancelled(info.session_id, now=self.clock())
        if info is None and self.policy.uses_events:
            return
        # Full blocks only: the partial tail block is never cached.
        num_full = request.num_computed_tokens // self.block_size
        hashes = [bytes(h) for h in list(request.block_hashes)[:num_full]]
        if info is not None:
            self.sessions.record_request(info.session_id, hashes, request.num_computed_tokens, req_id)
            if info.critical:
                self._critical_sessions.put(info.session_id, True, 1)
            else:
                self._critical_sessions.pop(info.session_id)
            if info.critical and hashes and info.next_stall is not None:
                # Only a session that announced a tool call is known to come back for its KV.
                until = self.clock() + self._expiry(info.next_stall.predicted_s or 0.0)
                self._watch_critical(info.session_id, tuple(hashes), until)
            if info.derive_stalls and info.next_stall is not None:
                self._begin_derived_stall(info, req_id)
        if (info is not None and info.next_stall is not None) or not self.policy.uses_events:
            try:
                self._on_finished(info, hashes, self.clock())
            except Exception:
                self.stats.inc("errors.early_save")
                log.exception("TokenCake: early save for %s failed", req_id)

    # ---- stalls derived from requests (clients without an events listener, e.g. behind a router)
    def _begin_derived_stall(self, info: _ReqInfo, req_id: str) -> None:
        """The request announced its tool call and finished: the tool starts now."""
        assert info.next_stall is not None
        begin = StallBegin(
            stall_id=f"derived:{req_id}"[:200],
            session_id=info.session_id,
            run_id=info.run_id or info.session_id,
            node=info.node or info.agent_type or "agent",
            agent_type=info.agent_type,
            tool=info.next_stall.tool,
            kind=info.next_stall.kind,
            predicted_s=info.next_stall.predicted_s,
            ts=time.time(),
        )
        if self.sessions.apply(begin).ok:
            self._derived.put(info.session_id, (begin, self.clock()), 64)
            self.stats.inc("events.derived_begin")

    def _end_derived_stall(self, session_id: str) -> None:
        """The session's next request arrived: its tool call is over."""
        open_ = self._derived.pop(session_id)
        if open_ is None:
            return
        begin, started = open_
        self._end_on_the_clients_behalf(begin, started, "events.derived_end")

    def _end_on_the_clients_behalf(self, begin: StallBegin, started: float, counter: str) -> None:
        """Apply the ``stall_end`` the client did not send (server clock), as if it had."""
        end = StallEnd(
            stall_id=begin.stall_id,
            session_id=begin.session_id,
            run_id=begin.run_id,
            node=begin.node,
            tool=begin.tool,
            duration_s=max(self.clock() - started, 0.0),
            ts=time.time(),
        )
        if self.sessions.apply(end).ok:
            self.stats.inc(counter)

    def _end_stalls_the_request_outlived(self, session_id: str) -> None:
        """The session sent its next request while its stall is still open: the end was lost.

        An agent calls the model again only after its tool calls returned (the SDK sends each
        end before the next request), so the stall is over. Ended here, it is accounted against
        this request and its host pins go once the request has what it needs; left open, they
        would last until the stall expires (up to an hour). A late real end is a duplicate.
        """
        sid = self._session_stall.get(session_id)
        stall = self._stalls.get(sid or "")
        if stall is None or stall.ended_at is not None:
            return
        for rec in self.sessions.active_stalls(session_id):
            self._end_on_the_clients_behalf(rec.begin, rec.begin_at, "events.inferred_end")

    # ---- chains
    def _chain(self, hashes: tuple[bytes, ...] | list[bytes]) -> list[tuple[int, bytes, Any, int | None]]:
        """``(position, hash, device block or None, host slot or None)`` of the usable chain prefix.

        A hit needs an unbroken chain from block 0, so the scan stops at the first block that is
        neither cached on device, nor on host, nor being copied there.
        """
        assert self.pool is not None
        chain: list[tuple[int, bytes, Any, int | None]] = []
        for i, h in enumerate(hashes):
            dev = self.pool.cached(h)  # (bad KV a failed load left is uncached)
            slot = self.host.lookup(h)
            if dev is None and slot is None:
                break
            chain.append((i, h, dev, slot))
        return chain

    def _gate_input(
        self, chain: list, predicted_s: float, elapsed_s: float, known: bool, now: float, session_id: str = ""
    ) -> GateInput:
        on_host = sum(1 for _i, h, _d, slot in chain if slot is not None or h in self._filling)
        left = remaining_s(predicted_s, elapsed_s, self.gate.overdue_factor)
        # Only a pool short of room needs victims, and only as many as are short.
        preemptible = len(self._victims_for(chain, len(chain) - on_host, now + left, session_id, now))
        return GateInput(
            predicted_s=predicted_s,
            num_blocks=len(chain),
            block_bytes=self.block_bytes,
            device_usage=self._eviction_risk(chain, left, now),
            num_waiting=len(self._waiting),
            host_free_blocks=self.host.num_free,
            num_on_host=on_host,
            host_reclaimable_blocks=self.host.num_reclaimable,
            host_preemptible_blocks=preemptible,
            elapsed_s=elapsed_s,
            session_known=known,
        )

    def _victims_for(
        self, chain: list, n: int, returns_at: float | None, session_id: str, now: float
    ) -> list[int]:
        """Victims a save of ``n`` blocks of ``chain`` needs beyond free and unheld slots."""
        short = n - self.host.num_free - self.host.num_reclaimable
        if returns_at is None or short <= 0:
            return []
        own = {h for _i, h, _d, _s in chain}
        return self._host_victims(returns_at, session_id, now, limit=short, own=own)

    def _host_victims(
        self,
        returns_at: float,
        session_id: str,
        now: float,
        *,
        limit: int | None = None,
        own: set[bytes] | frozenset[bytes] = frozenset(),
    ) -> list[int]:
        """Host slots a save for a session returning at ``returns_at`` may take (``preempts_host``).

        Belady's rule with the events' forecasts: when the pool is full, keep the copies of the
        sessions that return soonest. Candidates are offloaded stalls predicted to return later
        than ``returns_at`` (their remaining time stretched as the gate's when overdue), taken in
        eviction-queue order (non-critical first, latest return first), each chain tail first (a hit
        needs the chain from block 0, so the head is the last to go). Never a slot that anything
        else owns — a copy in flight (``job:``), a stall returning sooner, an ended stall whose next
        request will load it — nor a slot planned for a demand load, nor the copies of a session
        whose request waits or whose prefetch runs, nor a block of the saving session's own chain
        (``own``: a shared prefix it needs too). At most ``limit`` slots (None: all).
        """
        if not self.policy.preempts_host or not self._stalls:
            return []
        waiting = self._waiting_sessions()
        planned = {slot for _first, _hashes, slots in self._pending_load.values() for slot in slots}
        later: list[tuple[tuple[int, float], str, tuple[bytes, ...]]] = []
        for stall in self._stalls.values():
            if (
                not stall.offloaded
                or stall.ended_at is not None
                or stall.session_id == session_id
                or stall.session_id in waiting
                or stall.session_id in self._prefetching
            ):
                continue
            back = now + remaining_s(stall.predicted_s, now - stall.begin_at, self.gate.overdue_factor)
            if back > returns_at:
                rank = demote_rank(critical=stall.critical and self.critical_last, returns_at=back)
                later.append((rank, stall_owner(stall.stall_id), stall.hashes))
        return preemption_victims(self.host, later, limit=limit, own=own, skip=planned) if later else []

    def _view(
        self,
        chain: list,
        predicted_s: float,
        elapsed_s: float,
        known: bool,
        now: float,
        *,
        session_id: str,
        agent_type: str,
        tool: str | None,
        at_finish: bool,
        announced: bool,
    ) -> PolicyView:
        """Everything a policy may weigh for one session (see ``tokencake.serving.policies``)."""
        assert self.pool is not None
        gate = self._gate_input(chain, predicted_s, elapsed_s, known, now, session_id)
        on_host = gate.num_on_host
        return PolicyView(
            gate=gate,
            session_id=session_id,
            agent_type=agent_type,
            tool=tool,
            device_blocks=self.pool.num_blocks,
            device_free_blocks=self.pool.num_free(),
            waiting_blocks=sum(self._waiting.values()),
            recompute_s=self.profile.recompute_s(len(chain) * self.block_size),
            d2h_s=self.transfer.estimate("d2h", max(len(chain) - on_host, 0) * self.block_bytes),
            h2d_s=self.transfer.estimate("h2d", len(chain) * self.block_bytes),
            at_finish=at_finish,
            announced=announced,
            kept=session_id in self._kept,
            now_s=now,
            step_s=self._mean_step_s(),
        )

    def _count_plan(self, where: str, plan: Plan) -> None:
        self.stats.inc(f"policy.{where}.{plan.action}")
        self.stats.inc(f"policy.reason.{plan.reason}")

    def _plan_offload(
        self, chain: list, *, stall_id: str | None, session_id: str, returns_at: float | None = None
    ) -> _Job | None:
        """Pin the chain's device blocks that have no host copy yet and queue their copy.

        With ``returns_at`` (the session's predicted return) a full host pool yields the copies of
        sessions returning later (:meth:`_host_victims`). Raises :class:`HostPoolExhausted` when
        the host cannot take them (nothing is pinned then).
        """
        assert self.pool is not None
        todo = [
            (i, h, dev)
            for i, h, dev, slot in chain
            if slot is None and dev is not None and h not in self._filling
        ]
        if not todo:
            return None
        # The slots are allocated for the job about to be created (owner = its id), all or nothing.
        victims = self._victims_for(chain, len(todo), returns_at, session_id, self.clock())
        losers = {slot: self.host.owners(slot) for slot in victims}
        slots = self.host.allocate(len(todo), _Job.owner_of(self._next_job), victims)
        taken = [slot for slot in slots if slot in losers]
        if taken:
            self._after_host_preemption(taken, losers)
        blocks = [dev for _i, _h, dev in todo]
        self.pool.pin(blocks)
        job = self._new_job(
            "offload",
            [h for _i, h, _d in todo],
            [i for i, _h, _d in todo],
            blocks,
            slots,
            stall_id=stall_id,
            session_id=session_id,
        )
        job.device_owned = True
        for h in job.hashes:
            self._filling[h] = job.job_id
        self._outbox.append(job.to_wire())
        self.stats.inc("offload.jobs")
        return job

    def _after_host_preemption(self, taken: list[int], losers: dict[int, frozenset[str]]) -> None:
        """Stalls lost the tail of their host copy to a session returning sooner: their device
        blocks are no longer safe to evict first (what is left on device is all they have)."""
        self.stats.inc("host.preempted_blocks", len(taken))
        hit = {owner for slot in taken for owner in losers[slot]}
        for owner in hit:
            is_stall = owner.startswith(_STALL_OWNER)
            stall = self._stalls.get(owner.removeprefix(_STALL_OWNER)) if is_stall else None
            if stall is not None:
                self.stats.inc("host.preempted_stalls")
                self._promote(stall)

    def _on_finished(self, info: _ReqInfo | None, hashes: list[bytes], now: float) -> None:
        """A request finished: ask the policy while vLLM still holds its blocks.

        The blocks of a request that just finished sit at the safe end of the eviction queue, but
        under pressure they can be evicted before ``stall_begin`` reaches the engine; the session
        would then only get back the part an earlier turn had saved. Deciding here, with the
        announced tool's forecast, makes the save (or the pin) independent of that race. Policies
        that use no events (offload-all) decide here for every request.
        """
        if self.pool is None or not hashes:
            return
        nxt = info.next_stall if info is not None else None
        if nxt is None and self.policy.uses_events:
            return
        chain = self._chain(hashes)
        # The request reused its prefix's host copies: most recently used, head last (an LRU tier
        # must lose a chain's tail before its head; a hit needs the chain from block 0).
        reused = [slot for _i, _h, _d, slot in reversed(chain) if slot is not None]
        if reused:
            self.host.touch(reused)
        if not self.opts.offload and not self.policy.uses_events:
            return
        agent_type = info.agent_type if info is not None else ""
        predicted, tool = 0.0, None
        if nxt is not None:
            predicted = self.forecaster.predict(agent_type, nxt.tool, nxt.predicted_s).seconds
            tool = nxt.tool
        session_id = info.session_id if info is not None else ""
        view = self._view(
            chain,
            predicted,
            0.0,
            True,
            now,
            session_id=session_id,
            agent_type=agent_type,
            tool=tool,
            at_finish=True,
            announced=nxt is not None,
        )
        plan = self.policy.on_finished(view)
        if plan.action == "offload" and not self.opts.offload:
            plan = Plan("none", "disabled")
        self.stats.inc(f"early_save.decision.{plan.reason}")
        self._count_plan("finish", plan)
        if session_id:
            self._finish_decision.put(session_id, plan.reason, 1)
        if plan.action == "keep" and session_id:
            self._keep(session_id, chain, now + plan.keep_s, now)
            return
        # "discard" needs idle blocks: the request still holds them; the stall applies it.
        if plan.action != "offload":
            return
        try:
            job = self._plan_offload(chain, stall_id=None, session_id=session_id, returns_at=now + predicted)
        except HostPoolExhausted:
            self.stats.inc("early_save.host_pool_full")
            if session_id:
                self._finish_decision.put(session_id, "host_pool_full", 1)
            return
        if job is not None:
            self.stats.inc("early_save.jobs")
            self.stats.inc("early_save.blocks", len(job.hashes))

    # ---- keep (a policy holds a session's device blocks)
    def _keep(
        self,
        session_id: str,
        chain: list,
        until: float,
        now: float,
        *,
        rank: float | None = None,
        kind: str = "keep",
    ) -> None:
        """Hold the chain's device blocks until ``until`` (or the session's next admission).

        A session already held gets the chain's other blocks added (a second prefetch of the
        same stall) and the later deadline.
        """
        assert self.pool is not None
        held = self._kept.get(session_id)
        have = {b.block_id for b in held.blocks} if held is not None else set()
        blocks = [dev for _i, _h, dev, _s in chain if dev is not None and dev.block_id not in have]
        if held is None and not blocks:
            return
        if blocks:
            self.pool.pin(blocks)
        if self.decisions is not None:
            self._note(
                "hold", kind=kind, session=session_id, blocks=[b.block_id for b in blocks], until=until
            )
        if held is not None:
            held.blocks.extend(blocks)
            held.until = max(held.until, until)
            return
        self._kept[session_id] = _Keep(
            session_id,
            blocks,
            until,
            now,
            rank=until if rank is None else rank,
            kind=kind,
            critical=bool(self._critical_sessions.get(session_id)),
        )
        self.stats.inc(f"{kind}.sessions")
        self.stats.inc(f"{kind}.blocks", len(blocks))

    def _unkeep(self, session_id: str, why: str) -> None:
        held = self._kept.pop(session_id, None)
        if held is None:
            return
        if self.decisions is not None:
            self._note("release", kind=held.kind, session=session_id, why=why)
        if self.pool is not None:
            self.pool.release(held.blocks)
        self.stats.inc(f"{held.kind}.released.{why}")
        self.stats.observe(f"{held.kind}.held_s", max(self.clock() - held.since, 0.0))

    def _releasable(self, holds: Iterable[_Keep]) -> int:
        """Blocks that releasing all of ``holds`` together frees: those no one else references.
        Two holds of sessions that share a system prompt reference its blocks twice, so neither
        hold alone frees them (``_Keep.releasable``), but releasing both does."""
        refs: dict[int, int] = {}
        blocks: dict[int, KVCacheBlock] = {}
        for held in holds:
            for b in held.blocks:
                refs[id(b)] = refs.get(id(b), 0) + 1
                blocks[id(b)] = b
        return sum(blocks[k].ref_cnt <= n for k, n in refs.items())

    def _release_kept_until(
        self, enough: Callable[[], bool], why: str, *, spare: str = "", protect: frozenset[str] = frozenset()
    ) -> int:
        """Release holds until ``enough()``, in eviction order (``_hold_rank``); returns how many.

        ``spare``: a session whose hold stays (the request asking for room is its own);
        ``protect``: sessions whose holds stay (the critical reserve, ``_protected``).
        """
        released = 0
        for held in sorted(self._kept.values(), key=self._hold_rank, reverse=True):
            if enough():
                break
            if held.session_id == spare or held.session_id in protect:
                continue
            self._unkeep(held.session_id, why)
            released += 1
        return released

    def _hold_rank(self, held: _Keep) -> tuple[int, float]:
        """Which hold yields first when room is needed: the highest rank (as ``_evict_rank``)."""
        return demote_rank(critical=held.critical and self.critical_last, returns_at=held.rank)

    def _protected(self, info: _ReqInfo | None, waited_s: float) -> frozenset[str]:
        """Critical-path sessions whose held blocks this admission may not take (the reserve).

        Only with the spatial scheduler on, only against a non-critical agent request that has
        waited less than ``critical_reserve_wait_s`` (past it the reserve is lent: nothing starves),
        and at most ``critical_reserve_frac`` of the device: the holds of the critical sessions
        that return soonest, while their blocks fit in that share. Nothing is set aside when no
        critical chain is held (work-conserving), and running requests are never denied blocks
        (``_tick_keeps`` and ``free_for_running`` release holds for them whatever is protected).
        Plain requests (no TokenCake metadata) are never held back: a denied one would let the
        plain requests behind it go first, and they are served first come, first served.
        """
        if not self.critical_last or self.pool is None or info is None or info.critical:
            return frozenset()
        if waited_s >= self.opts.critical_reserve_wait_s:
            return frozenset()
        cap = int(self.opts.critical_reserve_frac * self.pool.num_blocks)
        return reserved_sessions(
            ((k.session_id, k.rank, k.releasable) for k in self._kept.values() if k.critical), cap
        )

    def reserved_blocks(self) -> int:
        """Device blocks held for critical-path sessions now (the reserve in use)."""
        if not self.critical_last:
            return 0
        return sum(len(k.blocks) for k in self._kept.values() if k.critical)

    def _tick_keeps(self, now: float) -> None:
        """Expired TTLs; room for the running requests' next blocks; and when requests wait while
        the engine computed nothing this step, the latest return goes (a hold must never stop
        every request from running)."""
        for sid, held in list(self._kept.items()):
            if held.until <= now:
                self._unkeep(sid, "ttl")
        if self._kept and self.pool is not None:
            # A running request that finds no free block for its next token is preempted: keep
            # one free block per running request (and the reserve) whatever is held.
            floor = max(self._reserve_blocks(), self._running)
            pool = self.pool
            self._release_kept_until(lambda: pool.num_free() >= floor, "reserve")
        stuck = self._last_step is not None and self._last_step[1] == 0 and bool(self._waiting)
        if stuck and self._kept:  # the critical reserve included: the engine must never idle
            latest = max(self._kept.values(), key=self._hold_rank)
            self._unkeep(latest.session_id, "pressure")

    def free_for_running(self) -> bool:
        """vLLM found no free block for a running request and is about to preempt one (it asks
        ``has_pending_block_frees`` first). A held chain is a device copy of KV we chose to keep,
        so it yields before any running request loses its own: release holds (latest return
        first, critical ones last, the reserve included) until a block frees.

        True: vLLM schedules no further running request this pass, and this pass admits no
        waiting one (``get_num_new_matched_tokens`` says "next step"), so the request allocates
        next step instead of being preempted. False (nothing held, or releasing frees nothing:
        the blocks are shared with running requests): vLLM preempts, as stock vLLM does.
        """
        pool = self.pool
        if pool is None or not self._kept:
            return False
        before = pool.num_free()
        self._release_kept_until(lambda: pool.num_free() > before, "running")
        if pool.num_free() <= before:
            return False
        self._running_short = True
        self.stats.inc("hold.yielded_to_running")
        return True

    def _reserve_blocks(self) -> int:
        assert self.pool is not None
        return max(
            self.opts.prefetch_reserve_blocks, int(self.opts.prefetch_reserve_frac * self.pool.num_blocks)
        )

    def _keep_free(self, exclude: str | None = None, *, ahead_of_queue: bool = False) -> int:
        """Device blocks a prefetch must leave free: the larger of the reserve, one block per
        running request (a decode that finds none preempts someone) and what the queued requests
        (but ``exclude``) need — not the queue's for a return kept ahead of it (``ahead_of_queue``,
        ``_reserve_returns``: the admissions that would take its room wait for it) — and every
        free block in the step after a running request found none (``free_for_running``). The
        prefetch budget and the readiness ``no_room`` test share it, so "no room" means exactly
        "the budget rule would not have uploaded it"."""
        if self._short_pass and self.pool is not None:
            return self.pool.num_free()  # a running request found no block: none to spare
        queued = 0 if ahead_of_queue else sum(n for r, n in self._waiting.items() if r != exclude)
        return max(self._reserve_blocks(), self._running, queued)

    def _reserve_returns(self, now: float) -> dict[str, int]:
        """Returns whose room is kept this step (``return_reserve``): the stalls whose tool still
        runs and whose upload is due, until the late end of their likely return
        (``PlannedStall.late_at``), soonest due first while they fit in ``return_reserve_frac``
        of the device. Each keeps the blocks of its chain that could come back (the run with a
        device or host copy from block 0) that no one but its own hold references: missing
        ones and idle cached ones, which an admission's allocation would take. The chain is
        walked once, when the window opens (cheap per step at any scale); its hold, as it grows
        with the upload, is subtracted."""
        pool = self.pool
        if not self.reserves_returns or pool is None or not self._stalls:
            return {}
        due: list[_Stall] = []
        for stall in self._stalls.values():
            if (
                stall.ended_at is None
                and not (stall.accounted or stall.resumed)
                and stall.offloaded
                and stall.reserve_from <= now <= stall.reserve_until
            ):
                due.append(stall)
            else:
                stall.reserve_blocks = None
        cap = int(self.opts.return_reserve_frac * pool.num_blocks)
        out = kept_room(((st.reserve_from, st.session_id, partial(self._kept_for, st)) for st in due), cap)
        self.stats.set("return_reserve.blocks", sum(out.values()))
        return out

    def _kept_for(self, stall: _Stall) -> int | None:
        """Blocks the stall's return keeps now: its chain's count (taken once the offload is
        confirmed) less its hold and the blocks an upload of it is copying into; None while the
        chain is not on host yet (no upload starts before it is)."""
        held = self._kept.get(stall.session_id)
        if stall.reserve_blocks is None:
            if self._offload_pending(stall):
                return None
            stall.reserve_blocks = self._room_to_return(stall, held)
        job = self._jobs.get(stall.prefetch_job) if stall.prefetch_job is not None else None
        copying = len(job.device_blocks) if job is not None and job.kind == "prefetch" else 0
        return stall.reserve_blocks - (len(held.blocks) if held is not None else 0) - copying

    def _room_to_return(self, stall: _Stall, held: _Keep | None) -> int:
        """Blocks of the chain's returnable run (device or host copy, unbroken from block 0)
        that no one but the session's own hold references."""
        assert self.pool is not None
        own = {b.block_id for b in held.blocks} if held is not None else set()
        n = 0
        for h in stall.hashes:
            block = self.pool.cached(h)
            if block is None:
                if self.host.lookup(h) is None:
                    break  # a hit needs an unbroken chain from block 0
                n += 1
            elif block.ref_cnt - (block.block_id in own) == 0:
                n += 1
        return n

    def _returning_against(self, info: _ReqInfo | None, own: str, waited: float) -> frozenset[str]:
        """Sessions whose kept room (``_reserve_returns``) this admission must leave free: an
        agent request's first admission (``waited`` finite), while requests run (their finishing
        frees blocks; an engine that would idle never waits), never its own session's. Plain
        requests (first come, first served) and re-admissions of preempted ones are never held
        back."""
        if not self._returning or info is None or not math.isfinite(waited) or self._running == 0:
            return frozenset()
        return frozenset(sid for sid in self._returning if sid != own)

    def _make_room(self, request: RequestView, num_computed_tokens: int) -> bool:
        """A waiting request is about to be allocated: release holds it needs the blocks of (and,
        spatial scheduler on, keep idle critical chains out of its eviction window).

        Runs inside vLLM's admission (before ``allocate_slots``), so a held chain never delays a
        request that could otherwise run; when even releasing every hold would not make it fit,
        nothing is released (the request waits for running ones either way). True: the request
        waits a step for the critical reserve instead — idle critical chains
        (``_spare_critical_chains``) or held ones (``_protected``) — and vLLM looks at the next one.
        """
        pool = self.pool
        if pool is None or not (
            self._kept or self._returning or (self.critical_last and len(self._critical_idle))
        ):
            return False
        info = self._reqs.get(request.request_id)
        own = info.session_id if info is not None else ""
        computed = list(request.block_hashes)[: num_computed_tokens // self.block_size]
        # vLLM's own test in ``allocate_slots``: the blocks the whole prompt (and its lookahead
        # slots) takes beyond its hits, plus the hits that sit in the free queue (it counts them
        # against the free blocks too), plus the watermark while requests run. An upper bound
        # when vLLM schedules only a chunk of the prompt this step.
        evictable = 0
        for h in computed:
            block = pool.cached(bytes(h))
            evictable += block is not None and block.ref_cnt == 0
        extra = evictable - len(computed)
        if self._running:
            extra += int(self.watermark * pool.num_blocks)
        need = -(-(int(request.num_tokens) + self.lookahead_tokens) // self.block_size) + extra
        waited = self._reserve_waited(request.request_id)
        own_hits = frozenset(bytes(h) for h in computed)
        # Room kept ahead of returns (``_reserve_returns``): the admission waits unless this step's
        # share of its prompt fits beside the kept room — counted like the rest, with vLLM's chunk
        # bound (``max_num_batched_tokens``): the later chunks it takes as a running request — and
        # it releases no hold (held chains are of sessions about to return too).
        returning = self._returning_against(info, own, waited)
        if returning:
            step = min(int(request.num_tokens), num_computed_tokens + self.max_step_tokens)
            step_need = -(-(step + self.lookahead_tokens) // self.block_size) + extra
            if pool.num_free() - step_need < sum(self._returning[sid] for sid in returning):
                self.stats.inc("return_reserve.denials")
                return True
        elif self._kept and pool.num_free() < need:
            protect = self._protected(info, waited)
            releasable = self._releasable(
                k for k in self._kept.values() if k.session_id != own and k.session_id not in protect
            )
            if pool.num_free() + releasable >= need:
                self._release_kept_until(lambda: pool.num_free() >= need, "room", spare=own, protect=protect)
            elif protect and pool.num_free() + releasable + self._protected_blocks(protect) >= need:
                # It would fit if the reserve were lent: it waits a step (bounded by
                # critical_reserve_wait_s) and vLLM looks at the next request, instead of failing
                # its allocation, which stops vLLM's admission loop for everyone behind it.
                self.stats.inc("spatial.reserve_denials")
                return True
        # After any release: released blocks join the back of the free queue, and the critical
        # chains this spares must stay behind them. (It can only ask the request to wait when
        # the request fits without releasing anything, so nothing is released for a waiter.)
        return self._spare_critical_chains(info, need, waited, own_hits, evictable)

    def _watch_critical(self, session_id: str, hashes: tuple[bytes, ...], until: float) -> None:
        self._unwatch_critical(session_id)
        # May push out the oldest watch (``on_evict`` keeps the index in step).
        self._critical_idle.put(session_id, _Watch(hashes, until), hashes_nbytes(hashes))
        for h in hashes:
            self._critical_owners.setdefault(h, set()).add(session_id)

    def _unwatch_critical(self, session_id: str) -> None:
        watch = self._critical_idle.pop(session_id)
        if watch is not None:
            self._forget_critical_hashes(session_id, watch)

    def _forget_critical_hashes(self, session_id: str, watch: _Watch) -> None:
        for h in watch.hashes:
            owners = self._critical_owners.get(h)
            if owners is not None:
                owners.discard(session_id)
                if not owners:
                    del self._critical_owners[h]

    def _spare_critical_chains(
        self,
        info: _ReqInfo | None,
        need: int,
        waited_s: float,
        own_hits: frozenset[bytes] = frozenset(),
        own_free: int = 0,
    ) -> bool:
        """Critical-last: a non-critical or plain admission about to allocate ``need`` blocks
        evicts other idle blocks before the idle chain of a critical-path session that is
        expected back (it announced a tool call: until that call's stall expiry, while the tool
        runs, or while its next request waits). True: the admission waits a step instead.

        Such a chain's blocks inside the eviction window move to the back of the free queue when
        they have no host copy (losing them costs the critical path a recompute; losing another
        idle block costs at most a non-critical session's). Host-safe blocks keep the place the
        eviction order gave them (first: a copy brings them back) — except from an admission
        that may wait for the critical reserve (:meth:`_may_wait_for_reserve`): it may take no
        block of such a chain, so those move back too, and if the window still holds one (fewer
        than ``need`` other blocks are free) it waits for running requests to free blocks or
        the session to return. Unlike held chains (pinned, so capped at
        ``critical_reserve_frac`` of the device), idle chains cost no one memory: what bounds
        this reserve is time — the wait ends with the admission's slack,
        ``critical_reserve_wait_s``, or the engine's last running request. The admission's own
        prefix hits (``own_hits``, ``own_free`` of them in the free queue and counted in ``need``:
        vLLM takes them before it allocates, so it never evicts them) are stepped over, and its
        own session's chain is never reserved against it. Spatial scheduler only.
        """
        pool = self.pool
        if not self.critical_last or pool is None or (info is not None and info.critical):
            return False
        owners, now = self._critical_owners, self.clock()
        if not owners:
            return False
        waiting: set[str] | None = None  # built only if a watched block is in the window
        may_wait = info is not None and self._may_wait_for_reserve(info, waited_s)
        own = info.session_id if info is not None else None

        def back(sid: str) -> bool:
            """Expected back: its stall_begin may not have come yet, the tool runs, or its next
            request waits — not a session gone silent past the announced tool's expiry."""
            nonlocal waiting
            watch = self._critical_idle.get(sid)
            if (watch is not None and now < watch.until) or self._active_stall(sid) is not None:
                return True
            if waiting is None:
                waiting = self._waiting_sessions()
            return sid in waiting

        def reserved(h: bytes) -> bool:
            sids = owners.get(h)
            return bool(sids) and any(sid != own and back(sid) for sid in sids)

        spare_safe = may_wait or self.opts.critical_spare_late

        def spare(h: bytes) -> bool:
            return reserved(h) and (spare_safe or self.host.lookup(h) is None)

        window = need - own_free  # the blocks it evicts or takes fresh
        skip = own_hits.__contains__ if own_hits else None
        spared = pool.in_eviction_window(spare, window, skip)
        if spared:
            moved = pool.reorder(spared, first=False)
            self.stats.inc("spatial.critical_spared_blocks", moved)
        if not may_wait or not spared or pool.num_free() < need:
            return False  # (a request that does not fit waits anyway, in vLLM's queue order)
        if not pool.in_eviction_window(reserved, window, skip):
            return False
        self.stats.inc("spatial.critical_reserve_waits")  # steps an admission waited
        if info is not None and not info.reserve_waited:
            info.reserve_waited = True
            self.stats.inc("spatial.critical_reserve_waited_requests")
        return True

    def _may_wait_for_reserve(self, info: _ReqInfo, waited_s: float) -> bool:
        """Whether this non-critical agent request may wait for the critical reserve: it has
        waited less than its slack (the app's end is not delayed) and ``critical_reserve_wait_s``,
        and requests run (their finishing frees blocks; an engine that would idle never waits).
        Plain requests never wait (first come, first served)."""
        return self.opts.critical_reserve_frac > 0 and self._within_slack(info, waited_s)

    def _reserve_waited(self, req_id: str) -> float:
        """How long the request has waited by the critical reserve's clock
        (``critical_reserve_wait_from``): since it arrived, or since vLLM's admission first looked
        at it (the head of the queue: queueing that delays every request does not count). inf for
        a re-admission (a preempted request): the reserve never holds it back."""
        arrived = self._arrival.get(req_id)
        if arrived is None:
            return math.inf
        if self.opts.critical_reserve_wait_from == "head":
            arrived = self._first_look.get(req_id, arrived)
        return max(self.clock() - arrived, 0.0)

    def _within_slack(self, info: _ReqInfo | None, waited_s: float | None) -> bool:
        """Whether an admission could still have waited without delaying its own app: an agent
        request on its first admission that has waited (``waited_s``, by the reserve's clock:
        :meth:`_reserve_waited`) less than its node's slack and ``critical_reserve_wait_s``,
        while requests run. Plain requests, re-admissions (None or inf) and requests past that
        point could not: an inversion they cause is "late"."""
        if info is None or waited_s is None or self._running == 0:
            return False
        return waited_s < min(info.slack_s, self.opts.critical_reserve_wait_s)

    def _protected_blocks(self, protect: frozenset[str]) -> int:
        return sum(k.releasable for k in self._kept.values() if k.session_id in protect)

    # ---- demand load
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> int | None:
        """Host-pool hits past the device prefix (tokens); None = ask again next step.

        None while a prefetch of the request's own session is being copied (the blocks are about
        to appear in the device prefix cache, loading them a second time would waste the copy),
        or while it waits for the critical reserve (``_spare_critical_chains``).
        """
        req_id = request.request_id
        if req_id in self._arrival and req_id not in self._first_look:
            self._first_look[req_id] = self.clock()
        if self._running_short:  # a running request gets the blocks held chains just gave back
            self.stats.inc("hold.admission_waits_for_running")
            if self.decisions is not None:
                self._note("wait", req=req_id, why="running")
            return None
        info = self._reqs.get(req_id)
        if info is not None:
            self._local_hit[req_id] = num_computed_tokens
            # Stall transitions may still be queued (no step since they arrived): apply them now so
            # this request is accounted against its stall. Only bookkeeping and pins happen here.
            self._drain(self.clock())
            job = self._jobs.get(self._prefetching.get(info.session_id, 0))
            if job is not None:
                if not info.waited_for_prefetch:
                    info.waited_for_prefetch = True
                    self.stats.inc("demand_load.waited_for_prefetch")
                if self.clock() - job.issued_at < self.opts.prefetch_wait_s:
                    if self.decisions is not None:
                        self._note("wait", req=req_id, why="prefetch")
                    return None
                # A copy this slow is not worth waiting for: load on demand (the prefetch's blocks
                # are its own; whichever lands second is simply not published).
                self.stats.inc("demand_load.gave_up_waiting")
        # Admitted this step unless it waits for the critical reserve: make room for it now (not
        # before a wait for its own prefetch, which would give others' holds away for nothing).
        if (info is None or not info.critical) and len(self._critical_idle) and self._critical_before is None:
            self._critical_before = self._critical_cached()  # once per scheduling pass (kept current)
        try:
            if self._make_room(request, num_computed_tokens):
                if self.decisions is not None:
                    self._note("wait", req=req_id, why="room")
                return None  # it waits a step for the critical reserve (``_spare_critical_chains``)
        except Exception:  # room is an optimisation: never fail the admission over it
            self.stats.inc("errors.make_room")
            log.exception("TokenCake: releasing holds for %s failed", req_id)
        if not self.opts.demand_load or self.pool is None or self.host.num_blocks == 0:
            return 0
        first = num_computed_tokens // self.block_size
        # Leave at least one prompt token to compute (vLLM needs a token to sample from).
        limit = (request.num_tokens - 1) // self.block_size
        hashes = list(request.block_hashes)[first:limit]
        found: list[int] = []
        for h in hashes:
            slot = self.host.lookup(bytes(h))
            if slot is None:
                break
            found.append(slot)
        if not found:
            self._pending_load.pop(req_id, None)
            return 0
        used = [bytes(h) for h in hashes[: len(found)]]
        self._pending_load[req_id] = (first, used, found)
        return len(found) * self.block_size

    def _record_provenance(
        self, request: RequestView, info: _ReqInfo | None, local_tokens: int, host_tokens: int
    ) -> None:
        """Where the prompt's KV came from at admission: device prefix hit (of it, blocks a prefetch
        of this session put there), host-pool load, computed. Returned with the response
        (``kv_transfer_params.tokencake_kv``) so a mismatch can be traced to its source.

        ``copied_tokens`` counts device hits on blocks whose KV a host copy wrote (any session's
        prefetch or load: a shared prefix); a block recomputed later under the same hash into the
        same block id would still count (the conservative side: blamed on the copy)."""
        mine: set[bytes] = set()  # blocks this session's prefetches uploaded
        if info is not None:
            for stall in (self._active_stall(info.session_id), self._last_stall.get(info.session_id)):
                if stall is not None:
                    mine.update(stall.prefetched)
        pool = self.pool if self._copied else None  # nothing copied on device: no lookups
        n_local = max(int(local_tokens), 0) // self.block_size
        hit = [bytes(h) for h in list(request.block_hashes)[:n_local]] if mine or pool is not None else []
        prefetched = copied = 0
        for h in hit:
            prefetched += h in mine
            block = pool.cached(h) if pool is not None else None
            copied += block is not None and self._copied.get(block.block_id) == h
        prev = self._provenance.get(request.request_id) or {}  # an earlier admission (preempted)
        failed_before = self._failed_copies.pop(info.session_id) if info is not None else None
        self._provenance[request.request_id] = {
            "device_tokens": int(local_tokens),
            "prefetched_tokens": prefetched * self.block_size,
            # Device hits on blocks a host copy wrote (this session's prefetch or anyone's copy).
            "copied_tokens": copied * self.block_size,
            "host_tokens": int(host_tokens),
            "prompt_tokens": int(getattr(request, "num_prompt_tokens", 0) or request.num_tokens),
            # > 1: preempted and admitted again (the latest admission's counts)
            "admissions": int(prev.get("admissions", 0)) + 1,
            # The session's offloads / prefetches that failed since its previous admission, and
            # (filled in when the copy reports) this request's own demand load that failed and
            # was recomputed by vLLM. Non-zero only with faults: what a faulty copy could touch.
            "failed_copy_tokens": int(failed_before or 0) + int(prev.get("failed_copy_tokens", 0)),
            "failed_load_tokens": int(prev.get("failed_load_tokens", 0)),
        }

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int], num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        # Where the external tokens start, set first: if anything below raises, ``fail_load``
        # must report this admission's blocks (not a previous admission's of the same request).
        planned = self._pending_load.get(req_id)
        self._usa_req = req_id
        self._usa_first = planned[0] if planned else self._local_hit.get(req_id, 0) // self.block_size
        self._waiting.pop(req_id, None)
        self._admitted[req_id] = request  # to find it again if vLLM preempts it (observe_step)
        reserve_waited = self._reserve_waited(req_id)  # by the reserve's clock (inf: re-admission)
        arrived = self._arrival.pop(req_id, None)
        self._first_look.pop(req_id, None)
        info = self._reqs.get(req_id)
        waited: float | None = None
        if arrived is not None:  # first admission (a preempted request's re-admission is not counted)
            waited = max(self.clock() - arrived, 0.0)
            self.policy.observe_queue_delay(waited)
            who = "plain" if info is None else "critical" if info.critical else "noncritical"
            self.stats.observe(f"queue_wait_s.{who}", waited)
        if info is not None:
            for stall in (self._active_stall(info.session_id), self._last_stall.get(info.session_id)):
                if stall is not None:
                    stall.resumed = True
        if info is not None:
            self._unwatch_critical(info.session_id)  # its blocks are in use again
        before, self._critical_before = self._critical_before, None
        if before is not None and (info is None or not info.critical):
            late = not self._within_slack(info, reserve_waited)
            self._critical_before = self._count_inversions(before, late)  # the next admission's baseline
        if info is not None and info.session_id in self._kept:
            # Admitted: the request now holds the prefix blocks it hit; the keep has done its job.
            self._unkeep(info.session_id, "admitted")
        pending = self._pending_load.pop(req_id, None)
        local = self._local_hit.pop(req_id, 0)
        try:
            self._record_provenance(request, info, local, num_external_tokens)
        except Exception:
            self.stats.inc("errors.provenance")
        try:
            if self._account_next_turn(request, local, num_external_tokens) and arrived is not None:
                self._first_token[req_id] = (request, arrived)
        except Exception:
            self.stats.inc("errors.accounting")
            log.exception("TokenCake: next-turn accounting failed")
        if num_external_tokens <= 0 or pending is None:
            return
        first, hashes, slots = pending
        n = num_external_tokens // self.block_size
        if n > len(hashes) or first + n > len(block_ids):
            raise RuntimeError(
                f"demand load plan mismatch for {req_id}: {n} blocks asked, {len(hashes)} planned, "
                f"{len(block_ids)} allocated"
            )
        assert self.pool is not None
        for h, slot in zip(hashes[:n], slots[:n], strict=True):
            if self.host.hash_of(slot) != h:
                raise RuntimeError(f"host slot {slot} no longer holds the planned block")
        blocks = [self.pool.block(b) for b in block_ids[first : first + n]]
        job = self._new_job(
            "load", hashes[:n], list(range(first, first + n)), blocks, slots[:n], req_id=req_id
        )
        job.downstream = (first, tuple(block_ids[first:]))
        self.host.pin_many(job.slots, job.owner)
        self._outbox.append(job.to_wire())
        self.stats.inc("demand_load.requests")
        self.stats.inc("demand_load.blocks", n)
        self.stats.inc("tokens.from_host", n * self.block_size)

    def _critical_cached(self) -> dict[str, frozenset[bytes]]:
        """Per watched critical session: the blocks of its idle chain that are cached on device."""
        pool = self.pool
        if pool is None:
            return {}
        return {
            sid: frozenset(h for h in watch.hashes if pool.cached(h) is not None)
            for sid, watch in self._critical_idle.items()
        }

    def _count_inversions(
        self, before: dict[str, frozenset[bytes]], late: bool
    ) -> dict[str, frozenset[bytes]]:
        """A non-critical request was admitted: did its allocation evict a critical session's KV?

        ``critical_inversions`` counts, per admission, each critical session that lost cached
        blocks to it (the issue's "a critical session's cached blocks evicted while a non-critical
        request allocated": one admission that evicts two sessions' chains is two inversions;
        ``critical_blocks_evicted`` counts the blocks); ``critical_inversions_unsaved`` those
        that took a block with no host copy — the ones that cost the critical path a recompute (a
        block safe on host comes back by a copy, which is why the eviction order lets those go
        first); ``critical_inversions_late`` those by an admission that could not have waited
        without delaying its own app (``late``: see :meth:`_within_slack`) — the ones the critical
        reserve may not prevent. Returns the cached blocks now."""
        after = self._critical_cached()
        for sid, cached in before.items():
            lost = cached - after.get(sid, cached)
            if not lost:
                continue
            unsaved = sum(self.host.lookup(h) is None for h in lost)
            self.stats.inc("spatial.critical_inversions")
            self.stats.inc("spatial.critical_blocks_evicted", len(lost))
            if late:
                self.stats.inc("spatial.critical_inversions_late")
            if unsaved:
                self.stats.inc("spatial.critical_inversions_unsaved")
                self.stats.inc("spatial.critical_blocks_evicted_unsaved", unsaved)
        return after

    def _room_for_chain(self, session_id: str, req_id: str) -> bool:
        """Whether the device could take the session's missing chain blocks right now under the
        prefetch budget rule (free − own idle − ``_keep_free`` without this request's own need,
        plus what other sessions' holds would yield). False means even a prefetch issued
        at this moment would have waited: the request queues for room whatever was prefetched."""
        pool = self.pool
        stall = self._last_stall.get(session_id) or self._active_stall(session_id)
        if pool is None or stall is None:
            return True
        missing = own_idle = 0
        for h in stall.hashes:
            block = pool.cached(h)
            if block is None:
                missing += 1
            else:
                own_idle += block.ref_cnt == 0
        if missing == 0:
            return True  # already on device: nothing to make room for
        yieldable = sum(k.releasable for k in self._kept.values() if k.session_id != session_id)
        room = pool.num_free() - own_idle - self._keep_free(exclude=req_id) + yieldable
        return room >= missing

    def _repeated_chain_on_device(self, session_id: str, request: RequestView) -> int | None:
        """Leading blocks of the session's last chain that ``request`` repeats and that are cached
        on device now (None: no chain, or no pool yet)."""
        pool = self.pool
        stall = self._last_stall.get(session_id) or self._active_stall(session_id)
        if pool is None or stall is None:
            return None
        limit = (request.num_tokens - 1) // self.block_size
        n = 0
        for old, new in zip(stall.hashes, list(request.block_hashes)[:limit], strict=False):
            if old != bytes(new) or pool.cached(old) is None:
                break
            n += 1
        return n

    def _count_recomputed(self, stall: _Stall, request: RequestView, first: int, end: int) -> None:
        """Why the blocks ``first..end`` of a resumed session's repeated prefix were recomputed
        (``next_turn.recomputed_why.<cause>``, in blocks): ``lost_before_decision`` (evicted from
        device before the stall was first decided, never on host), ``not_saved.<reason>`` (the stall
        was not offloaded for that reason), ``host_dropped`` (offloaded, the host copy gone since:
        reclaimed or preempted), ``on_host`` (a host copy exists but was not served: the chain broke
        before it), ``not_asked`` (the stall was never decided)."""
        hashes = list(request.block_hashes)
        for i in range(first, end):
            if self.host.lookup(bytes(hashes[i])) is not None:
                why = "on_host"
            elif stall.chain_at_decision is None:
                why = "not_asked"
            elif i >= stall.chain_at_decision:
                why = "lost_before_decision"
                # ... after the finish decided this (the save that would have kept it did not happen).
                self.stats.inc(f"next_turn.lost_before_decision_after.{stall.finish_decision or 'none'}")
            elif not stall.offloaded:
                why = f"not_saved.{stall.decision}"
            else:
                why = "host_dropped"
            self.stats.inc(f"next_turn.recomputed_why.{why}")

    def _account_next_turn(self, request: RequestView, local: int, external: int) -> bool:
        """Readiness, prefetch outcome and recomputed prefix tokens for a session's next turn.

        Returns whether the request is one (the first request of a session after a stall)."""
        info = self._reqs.get(request.request_id)
        if info is None:
            return False
        session_id = info.session_id
        stall = self._last_stall.get(session_id)
        if stall is None or stall.accounted:
            return False
        stall.accounted = True
        # The part of the previous turn this prompt repeats (the chat template may re-tokenize the
        # tail of the previous output differently, so compare hashes instead of assuming all).
        limit = (request.num_tokens - 1) // self.block_size
        common = 0
        for old, new in zip(stall.hashes, list(request.block_hashes)[:limit], strict=False):
            if old != bytes(new):
                break
            common += 1
        chain_tokens = common * self.block_size
        device = min(local, chain_tokens)
        served = min(local + external, chain_tokens)
        self.stats.inc("next_turn.requests")
        self.stats.inc("next_turn.prefix_tokens", chain_tokens)
        self.stats.inc("next_turn.prefix_tokens_device", device)
        self.stats.inc("next_turn.prefix_tokens_host", served - device)
        self.stats.inc("next_turn.prefix_tokens_recomputed", chain_tokens - served)
        if stall.critical:  # what the critical path recomputed: the cost a critical inversion has
            self.stats.inc("next_turn.critical.prefix_tokens", chain_tokens)
            self.stats.inc("next_turn.critical.prefix_tokens_recomputed", chain_tokens - served)
        self.stats.set("next_turn.last_recomputed", chain_tokens - served)
        if served < chain_tokens:
            self._count_recomputed(stall, request, served // self.block_size, common)
        self.stats.set("next_turn.last_device", device)
        self.stats.set("next_turn.last_host", served - device)
        # Readiness: were the blocks on device (or being copied there) when the request came? Only
        # stalls long enough for a copy to fit count; shorter ones nobody could have served. Judged
        # at arrival: a prefetch that lands while the request queues was not ready for it.
        on_device = device >= chain_tokens
        at_arrival = info.device_blocks_at_arrival
        ready_on_device = on_device if at_arrival is None else at_arrival * self.block_size >= chain_tokens
        ended_at = stall.ended_at if stall.ended_at is not None else self.clock()
        if chain_tokens > 0 and ended_at - stall.begin_at > stall.lead_s:
            if info.arrived_while_loading:
                ready = "loading"
            elif ready_on_device:
                ready = "prefetched" if stall.prefetched else "not_needed"
            else:
                ready = "missed"
                why = info.missed_why_at_arrival or miss_reason(
                    self.planner.get(stall.stall_id),
                    room_at_arrival=info.room_at_arrival,
                    deferred=stall.deferred,
                )
                self.stats.inc(f"readiness.missed_why.{why}")
            self.stats.inc("readiness.eligible")
            self.stats.inc(f"readiness.{ready}")
            if info.room_at_arrival is False:
                # The device had no room for the chain when the request came (running and queued
                # requests held it): being ready at arrival was not possible without starving them.
                self.stats.inc("readiness.no_room")
                self.stats.inc(f"readiness.no_room_{ready}")
        # Classify the session's planned stalls: on time only if the whole repeated prefix was on
        # device when the request came (a prefetch or blocks that were never evicted).
        # With prefetch off the planner still tracks the stall (pins, expiry): count apart so the
        # prefetch outcome counters only ever describe prefetches.
        outcome = "prefetch" if self.prefetch_enabled else "no_prefetch"
        for sid, cls in self.planner.on_request(session_id, hit_on_device=on_device, partial=stall.topup):
            self.stats.inc(f"{outcome}.{cls}")
            done = self._stall(sid)
            if cls == "on_time" and done is not None and done.prefetched:
                self.stats.inc("tokens.prefetched_hit", len(done.prefetched) * self.block_size)
            self._release_stall(sid)
        # The next turn has what it needs (loaded, hit or recomputed): unpin the host copies. They
        # stay indexed (LRU-reclaimable) for later hits. The record (and its hashes) is done.
        self._release_stall(stall.stall_id)
        self._last_stall.pop(session_id)
        return True

    def _watch_first_tokens(self, now: float, finished: str | None = None) -> None:
        """Time to first token of resumed turns: what the user of an agent waits after its tool."""
        for req_id, (request, arrived) in list(self._first_token.items()):
            if getattr(request, "num_output_tokens", 0) > 0:
                self.stats.observe("next_turn.ttft_s", now - arrived)
            elif req_id != finished:
                continue  # still queued or in prefill
            del self._first_token[req_id]

    def _release_stall(self, stall_id: str) -> None:
        """Unpin a stall's host copies and forget it (a prefetch in flight keeps its own pins)."""
        self.host.release(stall_owner(stall_id))
        self._ended.pop(stall_id, None)
        self._demoted.discard(stall_id)

    # ---- per step
    def build_jobs(self) -> list[CopyJob]:
        """Run the step's policy work and hand over the copies planned since the last call."""
        try:
            self._step(self.clock())
        except Exception:  # policy failure: skip this step's policy work, still ship planned loads
            self.stats.inc("errors.step")
            log.exception("TokenCake: step failed")
        jobs = self.flush()
        if jobs:
            self.stats.inc("steps.with_jobs")
        return jobs

    def flush(self) -> list[CopyJob]:
        """Hand over the planned copies (demand loads must reach the workers this very step)."""
        jobs, self._outbox = self._outbox, []
        for job in jobs:
            job.timeout_s = self.opts.job_timeout_s
        return jobs

    def fail_load(self, request: RequestView, block_ids: list[int], num_external_tokens: int) -> None:
        """Last resort when planning a demand load failed: make the workers report it failed."""
        first = self._usa_first if self._usa_req == request.request_id else 0
        n = -(-num_external_tokens // self.block_size)
        ids = block_ids[first : first + n] if block_ids else []
        self.stats.inc("demand_load.plan_failed")
        self._outbox.append(CopyJob(0, "load", list(ids), [], request.request_id, invalid=True))
        # As a failed load: what vLLM computes from these blocks is not to be saved.
        self._mark_suspect(request.request_id, first, block_ids[first:])

    def release_device_holds(self) -> int:
        """vLLM is about to reset its prefix cache, which fails while any device block is in use:
        give back the chains held on device (keeps, prefetched holds); returns how many. Copies in
        flight keep their pins until the workers report them (a reset during one still fails,
        as it does for vLLM's own connectors with transfers in flight)."""
        n = len(self._kept)
        for sid in list(self._kept):
            self._unkeep(sid, "reset")
        return n

    def _waiting_sessions(self) -> set[str]:
        """Sessions with a request queued for admission."""
        return {info.session_id for rid in self._waiting if (info := self._reqs.get(rid)) is not None}

    def device_copies_in_flight(self) -> int:
        """Copy jobs that still pin device blocks (until the workers report them): while any
        does, vLLM's prefix-cache reset cannot succeed."""
        return sum(1 for job in self._jobs.values() if job.device_owned and not job.released)

    def reset_cache(self) -> bool:
        """vLLM reset its prefix cache: forget every host copy; copies in flight commit nothing."""
        self._generation += 1
        if self.decisions is not None:
            self._note("reset")
        self._copied.clear()
        self._suspect.clear()  # no hash survives the reset
        self.release_device_holds()
        for sid in list(self._finish_pins):
            self._release_finish_pins(sid)
        dropped = self.host.reset()
        self._filling.clear()
        self._demoted.clear()
        self.stats.inc("reset.count")
        self.stats.inc("reset.host_blocks_dropped", dropped)
        log.info("TokenCake: prefix cache reset, %d host blocks dropped", dropped)
        return True

    def _release_finish_pins(self, session_id: str) -> None:
        if self._finish_pins.pop(session_id, None) is not None:
            self.host.release(_finish_owner(session_id))

    def _step(self, now: float) -> None:
        if now >= self._next_sweep:  # the tracker's safety net: old stalls, idle sessions
            self._next_sweep = now + 1.0
            self.sessions.sweep(now)
            for sid, deadline in list(self._finish_pins.items()):
                if deadline <= now:  # announced, but no stall came: the copies are the LRU's again
                    self._release_finish_pins(sid)
                    self.stats.inc("early_save.pins_expired")
        self._drain(now)
        self._critical_before = None  # a snapshot holds within one scheduling pass only
        if self._first_token:
            self._watch_first_tokens(now)
        waiting = bool(self._waiting)
        if waiting and not self._was_waiting:
            self._ask_backed_off_now(now)
        self._was_waiting = waiting
        if self._kept:
            self._tick_keeps(now)
        if self.critical_last and self.pool is not None:
            reserved = self.reserved_blocks()  # the reserve in use, every step: its ratio over time
            self.stats.set("spatial.reserved_blocks", reserved)
            self.stats.observe("spatial.reserved_frac", reserved / max(self.pool.num_blocks, 1))
            self.stats.inc("spatial.reserved_block_steps", reserved)  # Prometheus: ratio over time
            self.stats.inc("spatial.steps")
        self.profile.maybe_save(self._bandwidths())
        self._returning = self._reserve_returns(now)
        for stall in list(self._stalls.values()):
            try:
                self._tick_stall(stall, now)
            except Exception:
                self.stats.inc("errors.tick")
                log.exception("TokenCake: stall %s tick failed", stall.stall_id)
        if self.prefetch_enabled:
            self._recheck_prefetched(now)
            for sid in self.planner.due(now):
                stall = self._stall(sid)
                if stall is None:
                    self.planner.cancel(sid, "stall_forgotten")
                    continue
                try:
                    self._try_prefetch(stall, now)
                except Exception:
                    self.stats.inc("errors.prefetch")
                    self.planner.cancel(sid, "error")
                    log.exception("TokenCake: prefetch for %s failed", sid)
            for sid in list(self._topups):
                try:
                    self._try_topup(sid, now)
                except Exception:
                    self._topups.pop(sid, None)
                    self.stats.inc("errors.prefetch")
                    log.exception("TokenCake: prefetch top-up for %s failed", sid)
        for sid in self.planner.expired(now):
            # No end in time, or ended long ago without a next request: release the host pins.
            stall = self._pop_stall(sid)
            if stall is not None:
                self._forget_active(stall)
                self.sessions.expire(sid, "no_stall_end")
                self.stats.inc("stalls.expired.no_stall_end")
            self._release_stall(sid)
        self._expire_ended(now)
        self._timeout_jobs(now)
        self._update_wake_at()

    def _drain(self, now: float) -> None:
        for tr in self.sessions.drain():
            try:
                self._on_transition(tr, now)
            except Exception:
                self.stats.inc("errors.transition")
                log.exception("TokenCake: stall transition %s failed", tr.kind)

    def _add_stall(self, stall: _Stall) -> None:
        self._stalls[stall.stall_id] = stall
        self._stall_users.add(stall.stall_id, stall.hashes)

    def _pop_stall(self, stall_id: str) -> _Stall | None:
        stall = self._stalls.pop(stall_id, None)
        if stall is not None:
            self._stall_users.remove(stall_id, stall.hashes)
        return stall

    def _forget_active(self, stall: _Stall) -> None:
        if self._session_stall.get(stall.session_id) == stall.stall_id:
            del self._session_stall[stall.session_id]

    def _on_transition(self, tr: StallTransition, now: float) -> None:
        if tr.kind == "begin":
            ev = tr.event
            assert isinstance(ev, StallBegin)
            agent_type = ev.agent_type or ev.node
            fc = self.forecaster.predict(agent_type, ev.tool, ev.predicted_s, ev.stages)
            hashes = tr.blocks.block_hashes if tr.blocks is not None else ()
            stall = _Stall(
                ev.stall_id,
                ev.session_id,
                agent_type,
                ev.tool,
                tr.at,
                fc.seconds,
                tuple(hashes),
                known=tr.blocks is not None,
                critical=bool(self._critical_sessions.get(ev.session_id)),
                finish_decision=self._finish_decision.pop(ev.session_id),
            )
            stall.lead_s = (
                self.transfer.estimate("h2d", len(hashes) * self.block_bytes) + self.opts.prefetch_margin_s
            )
            self.stats.inc(f"forecast.source.{fc.source}")
            self._add_stall(stall)
            self._session_stall[stall.session_id] = stall.stall_id
            self._evaluate(stall, now)
            self._release_finish_pins(stall.session_id)  # the stall pins what it keeps
        elif tr.kind == "end":
            stall = self._pop_stall(tr.stall_id)
            ev = tr.event
            if stall is None:
                return
            self._forget_active(stall)
            stall.ended_at = tr.at
            held = self._kept.get(stall.session_id)
            if held is not None:
                held.until = min(held.until, tr.at + self.opts.keep_after_end_s)
            if isinstance(ev, StallEnd) and stall.known:
                # Only sessions that sent a request teach the shared forecasts: events alone,
                # for sessions that do not exist, must not steer every tenant's tool durations.
                self.policy.observe_stall_end(f"{stall.agent_type}/{stall.tool}", ev.duration_s)
                self.forecaster.observe(stall.agent_type, stall.tool, ev.duration_s, stall.predicted_s)
                self.stats.observe("forecast.error_s", stall.predicted_s - ev.duration_s)
                # The stall as the server saw it minus as the client timed it: event delivery lag.
                self.stats.observe("stalls.server_minus_client_s", (tr.at - stall.begin_at) - ev.duration_s)
            self._finish_stall(stall)
            # The tool is back: its idle device blocks are the next to be used, not evicted.
            self._promote(stall)
            plan = self.planner.get(stall.stall_id)
            if plan is not None and plan.state in ("waiting", "on_device"):
                if plan.state == "on_device" and not stall.topup and not self._chain_on_device(stall):
                    # A stall longer than predicted: what was prefetched (or still cached) at the
                    # due time was evicted since; the planner makes it due again at the end. (A
                    # chain uploaded in part is topped up instead: ``_try_topup``.)
                    self.planner.mark_evicted(stall.stall_id, now=tr.at, retry=False)
                elif plan.state == "waiting" and plan.due_at > tr.at:
                    self.stats.inc("prefetch.triggered_by_end")  # an end earlier than predicted
                self.planner.end(stall.stall_id, now=tr.at)
            elif plan is not None:
                self.planner.end(stall.stall_id, now=tr.at)
        else:  # expired by the tracker's safety net
            stall = self._pop_stall(tr.stall_id)
            if stall is not None:
                self._forget_active(stall)
                self._expire(stall, tr.detail or "expired")

    def _finish_stall(self, stall: _Stall) -> None:
        self.stats.inc(f"stalls.final_decision.{stall.decision or 'undecided'}")
        self._ended[stall.stall_id] = stall
        self._last_stall.put(stall.session_id, stall, hashes_nbytes(stall.hashes))
        if stall.decision is not None:
            self.sessions.set_decision(stall.stall_id, stall.decision)

    def _retry_in(self, stall: _Stall) -> float:
        """When to ask a retryable "no" again: at once while requests wait, else backing off."""
        base = self.opts.reevaluate_s
        if self._waiting:
            stall.retry_s = base
        else:
            stall.retry_s = min(max(stall.retry_s * 2, base), max(self.opts.reevaluate_max_s, base))
        return stall.retry_s

    def _ask_backed_off_now(self, now: float) -> None:
        """Requests started waiting: pressure may have come, ask every backed-off stall now."""
        for stall in self._stalls.values():
            if stall.retry_s > self.opts.reevaluate_s and math.isfinite(stall.next_eval):
                stall.retry_s = 0.0
                stall.next_eval = now

    def _evaluate(self, stall: _Stall, now: float) -> None:
        """Ask the gate; on yes pin the device chain and plan the device → host copy."""
        if self.pool is None:
            return
        chain = self._chain(stall.hashes)
        view = self._view(
            chain,
            stall.predicted_s,
            max(0.0, now - stall.begin_at),
            stall.known,
            now,
            session_id=stall.session_id,
            agent_type=stall.agent_type,
            tool=stall.tool,
            at_finish=False,
            announced=False,
        )
        plan = self.policy.on_stall(view)
        if plan.action == "offload" and not self.opts.offload:
            plan = Plan("none", "disabled")
        first = stall.decision is None
        if first:
            stall.chain_at_decision = len(chain)
        if not first and plan.reason == "no_blocks":
            # The blocks were evicted while we waited for pressure or room: keep the reason we were
            # waiting for (that is why nothing was offloaded) and stop asking.
            self.stats.inc(f"stalls.lost_while_waiting.{stall.decision}")
            stall.next_eval = float("inf")
            return
        stall.decision = plan.reason
        if first:
            self.stats.inc(f"stalls.decision.{plan.reason}")
            self._count_plan("stall", plan)
        self.sessions.set_decision(stall.stall_id, plan.reason)
        if plan.action == "keep":
            self._keep(stall.session_id, chain, now + plan.keep_s, now)
        elif plan.action == "discard" and self.demote_enabled:
            # Nothing is copied: the idle device blocks are the first to go (tail first).
            blocks = self._chain_blocks(stall, on_host_only=False, first_in_line=True)
            moved = self.pool.reorder(blocks, first=True)
            self.stats.inc("evict_order.discarded_blocks", moved)
        if plan.action != "offload":
            stall.next_eval = now + self._retry_in(stall) if plan.retry else float("inf")
            return
        stall.evict_first = plan.evict_first
        try:
            left = remaining_s(stall.predicted_s, max(0.0, now - stall.begin_at), self.gate.overdue_factor)
            self._plan_offload(
                chain, stall_id=stall.stall_id, session_id=stall.session_id, returns_at=now + left
            )
        except HostPoolExhausted:
            # Room may come back (other stalls end, copies finish): ask again, as for a gate "no".
            stall.decision = "host_pool_full"
            stall.next_eval = now + self.opts.reevaluate_s
            self.stats.inc("stalls.decision.host_pool_full_at_alloc")
            return
        stall.next_eval = float("inf")
        # Host copies that already exist (an earlier turn's prefix, an early save) get pinned for
        # this stall now; copies still in flight are pinned when they commit.
        for _i, _h, _dev, slot in chain:
            if slot is not None:
                self.host.pin(slot, stall_owner(stall.stall_id))
        stall.offloaded = True
        h2d = self.transfer.estimate("h2d", len(chain) * self.block_bytes)
        planned = self.planner.begin(
            stall.stall_id,
            stall.session_id,
            stall.predicted_s,
            h2d,
            key=f"{stall.agent_type}/{stall.tool}",
            wait_s=self._step_wait_s(),
            now=stall.begin_at,
            mode=plan.prefetch,
        )
        stall.reserve_from, stall.reserve_until = planned.due_at, planned.late_at
        if not first:
            self.stats.inc("stalls.offload_after_retry")
        if not self._offload_pending(stall):
            self._demote(stall)

    def observe_step(
        self,
        num_scheduled_tokens: int,
        now: float | None = None,
        *,
        num_running: int = 0,
        preempted: Iterable[str] = (),
    ) -> None:
        """Record one step's scheduled tokens (each needs KV: the rate at which blocks get allocated).

        ``preempted``: ids of requests vLLM put back in its waiting queue this step. vLLM tells the
        connector nothing else about them, and a hold must not keep them waiting while the engine
        idles (``_tick_keeps``), nor a prefetch take the room they need."""
        self._short_pass, self._running_short = self._running_short, False  # that pass is over
        preempted = list(preempted)
        for req_id in preempted:
            request = self._admitted.get(req_id)
            if request is not None:
                self._waiting[req_id] = -(-int(request.num_tokens) // self.block_size)
        if preempted:
            self._attribute_preemptions(len(preempted))
        t = self.clock() if now is None else now
        n = max(0, int(num_scheduled_tokens))
        self._running = max(0, int(num_running))
        self._steps.append((t, n))
        while self._steps and t - self._steps[0][0] > self.opts.churn_window_s:
            self._steps.popleft()
        last = self._last_step
        if last is not None and last[1] > 0 and n > 0:
            # Both steps ran work: the gap is how long that step took (an idle engine's gaps
            # would say nothing about how soon it acts on a copy).
            gap = min(max(t - last[0], 0.0), 60.0)
            self._step_gaps.append(gap)
            self.profile.observe_step(last[1], gap)
        self._last_step = (t, n)

    def _attribute_preemptions(self, n: int) -> None:
        """vLLM preempted ``n`` running requests this step (a running request found no free block):
        count what the extension kept out of the free queue at that moment — device blocks pinned
        by offload copies in flight (early saves, stall offloads: stock vLLM would have had them
        free or evictable) and those held for sessions (keeps, prefetched chains). A preemption
        with neither would have happened on stock vLLM too (``preemptions.kept.none``)."""
        pinned = sum(
            len(job.device_blocks)
            for job in self._jobs.values()
            if job.kind == "offload" and job.device_owned and not job.released
        )
        held = sum(len(k.blocks) for k in self._kept.values())
        self.stats.inc("preemptions.requests", n)
        self.stats.inc("preemptions.steps")
        if pinned:
            self.stats.inc("preemptions.kept.offload_pins")
            self.stats.inc("preemptions.offload_pinned_blocks", pinned)
        if held:
            self.stats.inc("preemptions.kept.holds")
            self.stats.inc("preemptions.held_blocks", held)
        if not pinned and not held:
            self.stats.inc("preemptions.kept.none")

    def _mean_step_s(self) -> float:
        """Mean duration of the recent engine steps that ran work (0 before two such steps)."""
        return sum(self._step_gaps) / len(self._step_gaps) if self._step_gaps else 0.0

    def _step_wait_s(self) -> float:
        """Expected wait from a random moment to the engine's next step boundary, in seconds.

        A prefetch decided between two steps ships with the next one, so the lead must cover
        that wait. For a moment picked at random the wait is E[d²] / 2E[d] over step durations
        d (long prefill steps weigh more than their count: one is more likely to be under way);
        on a GPU that is milliseconds, on vLLM-CPU seconds.
        """
        gaps = tuple(self._step_gaps)  # a copy: /v1/stats reads this from the listener's thread
        total = sum(gaps)
        if total <= 0:
            return 0.0
        return sum(d * d for d in gaps) / (2.0 * total)

    def _alloc_rate(self, now: float) -> float:
        """Blocks allocated per second over the recent window (0 when idle)."""
        steps = tuple(self._steps)  # a copy: /v1/stats reads this from the listener's thread
        if not steps:
            return 0.0
        span = max(now - steps[0][0], 1.0)
        return sum(n for _t, n in steps) / self.block_size / span

    def _eviction_risk(self, chain: list, left_s: float, now: float) -> float:
        """How likely the chain's idle device blocks are evicted before the session returns, in [0, 1].

        vLLM evicts idle cached blocks from the front of its free queue. The session's blocks
        survive while the allocations still to come stay below the free blocks queued ahead of
        them. Expected allocations: the blocks the queued requests need, plus the measured rate
        × the time left × ``churn_safety``, and at least one full step (a single prefill step can
        take that many at once, between two of our checks). Risk = expected / blocks ahead, capped
        at 1; blocks that are all in use (nothing idle to evict) are at no risk.

        Neither vLLM's ``get_usage`` (ignores idle cached blocks: "no pressure" while a prefix is
        about to go) nor the share of cached blocks (always "pressure" once the cache is warm)
        answers this question; the session's place in the eviction queue does.
        """
        pool = self.pool
        assert pool is not None
        mine = {dev.block_id for _i, _h, dev, _s in chain if dev is not None and pool.is_idle_cached(dev)}
        if not mine:
            return 0.0
        expected = sum(self._waiting.values()) + max(
            self.opts.churn_safety * self._alloc_rate(now) * max(left_s, 0.0),
            self.max_step_tokens / self.block_size,
        )
        # Walk only as far as the threshold can matter (the queue may hold 100k blocks on a GPU).
        ahead = pool.blocks_ahead(mine, limit=int(expected / max(self.gate.usage_threshold, 0.05)) + 1)
        risk = 1.0 if ahead == 0 else min(1.0, expected / ahead)
        self._last_risk = risk
        return risk

    # ---- eviction order
    def _chain_blocks(
        self, stall: _Stall, *, on_host_only: bool, first_in_line: bool = False
    ) -> list[KVCacheBlock]:
        """The stall's cached device blocks in eviction order (tail first, the head last).

        ``first_in_line``: they are about to go to the front of the eviction queue; a block that
        another live stall's chain shares (a common system prompt) is left out when that stall
        should keep it longer (:meth:`_kept_by_another`), so one session's demotion never costs
        the others their device hits."""
        assert self.pool is not None
        out: list[KVCacheBlock] = []
        for h in stall.hashes:
            block = self.pool.cached(h)
            if block is None:
                continue
            if on_host_only and self.host.lookup(h) is None:
                continue
            if first_in_line and self._kept_by_another(stall, h):
                continue
            out.append(block)
        out.reverse()
        return out

    def _kept_by_another(self, stall: _Stall, h: bytes) -> bool:
        """Whether another live stall that holds block ``h`` should lose it later than ``stall``:
        one not demoted (it was not offloaded, or is not evicted first), or one demoted behind it
        (an equal or lower eviction rank). A shared block then moves with that stall, if ever."""
        others = self._stall_users.others(stall.stall_id, h)
        if not others:
            return False
        rank = self._evict_rank(stall)
        return any(
            (other := self._stalls.get(sid)) is not None
            and (sid not in self._demoted or self._evict_rank(other) <= rank)
            for sid in others
        )

    def _demote(self, stall: _Stall) -> None:
        """Put the idle device blocks of an offloaded stall first in line for eviction.

        vLLM's free queue is LRU, and a session that just went idle is its most recently used
        entry: stock vLLM evicts the *active* sessions' prefixes first. Once a stalled session's
        chain is safe on host its device copy is the cheapest thing to lose (a host → device copy
        brings it back), so it goes to the front: non-critical sessions ahead of critical-path ones
        (a critical session's recompute delays its whole app), and within each, the session that
        returns last ahead of the others (KVFlow's steps-to-execution order, with time instead of
        steps). Only blocks with a ready host copy move.
        """
        if not self.demote_enabled or self.pool is None or stall.stall_id not in self._stalls:
            return
        if not stall.evict_first:
            return
        self._demoted.add(stall.stall_id)
        demoted = [s for s in (self._stalls.get(sid) for sid in self._demoted) if s is not None]
        rank = self._evict_rank
        if all(rank(s) <= rank(stall) for s in demoted):
            # It is evicted first (the usual case: it began last): only its chain moves to the
            # front, in front of the others' — the order a full re-queue gives, in O(chain) instead
            # of O(demoted × chain) (a thousand stalled sessions with long chains on a GPU).
            order = [stall]
        else:
            order = sorted(demoted, key=rank)
        moved = 0
        for s in order:  # each batch goes in front of the previous one: the latest return ends first
            blocks = self._chain_blocks(s, on_host_only=True, first_in_line=True)
            moved += self.pool.reorder(blocks, first=True)
        self.stats.inc("evict_order.demoted_blocks", moved)

    def _evict_rank(self, stall: _Stall) -> tuple[int, float]:
        """A demoted chain's place in the eviction queue: the highest rank is evicted first."""
        return demote_rank(critical=stall.critical and self.critical_last, returns_at=stall.returns_at)

    def _promote(self, stall: _Stall) -> None:
        """The session is about to run again: its idle device blocks go back to the safe end."""
        if stall.stall_id not in self._demoted:
            return
        self._demoted.discard(stall.stall_id)
        if self.demote_enabled and self.pool is not None:
            moved = self.pool.reorder(self._chain_blocks(stall, on_host_only=False), first=False)
            self.stats.inc("evict_order.promoted_blocks", moved)

    def _expiry(self, predicted_s: float) -> float:
        """How long a stall predicted to last ``predicted_s`` may go without its end."""
        o = self.opts
        return stall_expiry_s(predicted_s, factor=o.expiry_factor, min_s=o.expiry_min_s, max_s=o.expiry_max_s)

    def _tick_stall(self, stall: _Stall, now: float) -> None:
        if stall.next_eval <= now and stall.ended_at is None:
            self._evaluate(stall, now)
        expiry = self._expiry(stall.predicted_s)
        # An offloaded stall is the planner's to expire while it is planned; once its plan is gone
        # (a failed or timed-out prefetch, a reset) the same deadline applies here.
        planned = stall.offloaded and self.planner.is_open(stall.stall_id)
        if not planned and now - stall.begin_at >= expiry:
            self._pop_stall(stall.stall_id)
            self._forget_active(stall)
            self.sessions.expire(stall.stall_id, "no_stall_end")
            self._expire(stall, "no_stall_end")

    def _expire(self, stall: _Stall, reason: str) -> None:
        self.stats.inc(f"stalls.expired.{reason}")
        self.planner.cancel(stall.stall_id, "expired")
        self._release_stall(stall.stall_id)

    def _expire_ended(self, now: float) -> None:
        """Ended stalls the planner does not expire are forgotten here: never offloaded, after the
        grace period; offloaded but no longer planned (its prefetch failed or timed out: the plan
        was cancelled), as long after the end as the planner keeps a plan for a session that sends
        no request — without this its host pins would last until the session's next request."""
        waiting: set[str] | None = None  # sessions with a request queued (built when needed)
        for sid, stall in list(self._ended.items()):
            if stall.ended_at is None:
                continue
            grace = self.opts.end_grace_s
            if stall.offloaded:
                if self.planner.is_open(sid):
                    continue  # the planner expires it (``planner.expired``)
                grace = max(grace, self.planner.unused_after_s)
            if now - stall.ended_at < grace:
                continue
            if stall.offloaded:
                if waiting is None:
                    waiting = self._waiting_sessions()
                if stall.session_id in waiting:
                    continue  # its request is queued: the copies stay pinned for its load
            self._release_stall(sid)

    # ---- prefetch
    def _chain_on_device(self, stall: _Stall) -> bool:
        """Whether every block of the stall's chain that has a host copy is cached on device."""
        if self.pool is None:
            return False
        for h in stall.hashes:
            if self.pool.cached(h) is None and self.host.lookup(h) is not None:
                return False
        return True

    def _recheck_prefetched(self, now: float) -> None:
        """Prefetched chains of tools still running that were evicted since: upload again (bounded)."""
        for plan in self.planner.open_stalls():
            if plan.state != "on_device" or plan.ended_at is not None:
                continue
            stall = self._stalls.get(plan.stall_id)
            # A chain uploaded in part is topped up (``_try_topup``), whatever of it is missing.
            if stall is not None and not stall.topup and not self._chain_on_device(stall):
                self.planner.mark_evicted(plan.stall_id, now=now)

    def _try_topup(self, stall_id: str, now: float) -> None:
        """Upload the rest of a chain whose last upload brought only its head, once the budget
        has room again — while the tool runs or its request has not come (then the request's own
        demand load brings the rest). One copy in flight per session."""
        stall = self._stall(stall_id)
        plan = self.planner.get(stall_id)
        if (
            stall is None
            or plan is None
            or plan.state not in ("prefetching", "on_device")
            or plan.waiting_since is not None
            or stall.accounted
            or stall.resumed
        ):
            self._topups.pop(stall_id, None)  # ``stall.topup`` stays: what the request found
        elif plan.state == "on_device" and stall.session_id not in self._prefetching:
            self._try_prefetch(stall, now, topup=True)

    def _try_prefetch(self, stall: _Stall, now: float, *, topup: bool = False) -> None:
        """Bring the stall's missing chain blocks back into the device prefix cache (planner: due).

        Budget: the free blocks minus what must stay free — the larger of the reserve and the
        blocks the queued requests need — so a prefetch never starves the queue, but a queue that
        has its blocks does not stop it either. A budget smaller than the need prefetches the
        chain's head (a usable prefix) and tops up the rest when room frees (``topup``: this call
        is such a top-up; the plan is already ``on_device``); demand load brings what is still
        missing when the request comes.
        """
        pool = self.pool
        if pool is None:
            return
        self._promote(stall)  # blocks still on device must survive the allocation below
        if self._offload_pending(stall):
            return  # stays due: retried once the offload is confirmed
        need: list[tuple[int, bytes, int]] = []
        own_idle = 0
        for i, h in enumerate(stall.hashes):
            block = pool.cached(h)
            if block is not None:
                own_idle += block.ref_cnt == 0
                continue
            slot = self.host.lookup(h)
            if slot is None:
                break  # a hit needs an unbroken chain from block 0
            need.append((i, h, slot))
        if not need:
            if topup:  # the rest came back some other way (or is not on host): nothing to top up
                self._topups.pop(stall.stall_id, None)
                stall.topup = False
                return
            # Everything is still cached on device: nothing to copy (the end re-checks).
            self.planner.mark_started(stall.stall_id, now=now)
            self.planner.mark_done(stall.stall_id, now=now)
            self.stats.inc("prefetch.not_needed")
            return
        # Our own idle cached blocks are counted free by vLLM, but allocating them would break the chain.
        keep = self._keep_free(ahead_of_queue=stall.session_id in self._returning)
        budget = pool.num_free() - own_idle - keep
        if budget <= 0:
            if topup:
                return  # tried again next step
            if stall.deferred == 0:
                queued = sum(self._waiting.values())
                reserve = max(self._reserve_blocks(), self._running)
                self.stats.inc(
                    "prefetch.deferred.waiting" if queued > reserve else "prefetch.deferred.headroom"
                )
            stall.deferred += 1
            return
        stall.topup = budget < len(need)
        if stall.topup:
            need = need[:budget]
            self.stats.inc("prefetch.topup_partial" if topup else "prefetch.partial")
            self._topups[stall.stall_id] = None
        else:
            self._topups.pop(stall.stall_id, None)
        if topup:
            self.stats.inc("prefetch.topups")
        blocks = pool.allocate(len(need))
        job = self._new_job(
            "prefetch",
            [h for _i, h, _s in need],
            [i for i, _h, _s in need],
            blocks,
            [s for *_x, s in need],
            stall_id=stall.stall_id,
            session_id=stall.session_id,
        )
        job.device_owned = True
        self.host.pin_many(job.slots, job.owner)
        stall.prefetch_job = job.job_id
        self._prefetching[stall.session_id] = job.job_id
        self.planner.mark_started(stall.stall_id, now=now)
        self._outbox.append(job.to_wire())
        self.stats.inc("prefetch.jobs")

    # ---- jobs
    def _new_job(
        self,
        kind: JobKind,
        hashes: list[bytes],
        positions: list[int],
        blocks: list[KVCacheBlock],
        slots: list[int],
        *,
        stall_id: str | None = None,
        req_id: str | None = None,
        session_id: str | None = None,
    ) -> _Job:
        job = _Job(
            self._next_job,
            kind,
            hashes,
            positions,
            blocks,
            list(slots),
            self.clock(),
            stall_id,
            req_id,
            session_id,
            self._generation,
        )
        self._next_job += 1
        self._jobs[job.job_id] = job
        if self.decisions is not None:
            ids = [b.block_id for b in blocks]
            self._note(
                "job", kind=kind, job=job.job_id, hashes=hashes, blocks=ids, slots=job.slots, req=req_id
            )
        return job

    def on_worker_meta(self, meta: CopyReport | None) -> None:
        if meta is None:
            return
        if meta.disabled and self.copies_disabled is None:
            self._disable_copies(meta.disabled)
        # Loads first: a failed one marks the blocks computed from it (``_mark_suspect``) before
        # an offload of them that the same report confirms is committed.
        results = sorted(
            meta.results.items(), key=lambda item: getattr(self._jobs.get(item[0]), "kind", "") != "load"
        )
        for job_id, res in results:
            job = self._jobs.get(job_id)
            if job is None:
                continue
            try:
                # Act only once every worker reported: a rank whose copy failed must not free
                # blocks another rank is still writing.
                job.reports += res.workers
                job.ok = job.ok and res.ok
                if job.reports < self.num_workers:
                    continue
                if job.abandoned:
                    self.stats.inc("jobs.late_reports")
                    self._complete(job, ok=False, seconds=res.seconds, error="reported after its timeout")
                else:
                    self._complete(job, ok=job.ok, seconds=res.seconds, error=res.error)
            except Exception:  # one bad completion must not strand the others of this batch
                self.stats.inc("errors.complete")
                log.exception("TokenCake: completing job %d failed", job_id)
                self._jobs.pop(job_id, None)
                self._release(job)
        if self._suspect:
            self._prune_suspect()

    def _complete(self, job: _Job, *, ok: bool, seconds: float, error: str | None) -> None:
        self._jobs.pop(job.job_id, None)
        if self.decisions is not None:
            self._note(
                "complete", kind=job.kind, job=job.job_id, ok=ok, stale=job.generation != self._generation
            )
        nbytes = len(job.slots) * self.block_bytes
        kind = job.kind
        if ok:
            self.stats.inc(f"{kind}.blocks", len(job.slots))
            self.stats.inc(f"{kind}.bytes", nbytes)
            self.stats.observe(f"{kind}.seconds", seconds)
            if seconds > 0:
                self.stats.observe(f"{kind}.bytes_per_s", nbytes / seconds)
            self.transfer.observe("d2h" if kind == "offload" else "h2d", nbytes, seconds)
        else:
            self.stats.inc(f"{kind}.failed")
            log.warning("TokenCake %s job %d failed: %s", kind, job.job_id, error)
        stale = job.generation != self._generation
        if stale:
            self.stats.inc(f"{kind}.dropped_after_reset")
        try:
            if kind == "offload":
                self._complete_offload(job, ok and not stale)
            elif kind == "prefetch":
                self._complete_prefetch(job, ok and not stale)
            else:
                self._complete_load(job, ok)
        finally:
            self._release(job)
        if not ok:  # after the release: bookkeeping for provenance must never strand pins
            self._trace_failed_copy(job)
        if kind == "offload":
            self._after_offload(job)
        elif kind == "prefetch" and ok and not stale:
            self._hold_prefetched(job)

    def _trace_failed_copy(self, job: _Job) -> None:
        """Remember a failed copy for the provenance of the request it could have fed."""
        tokens = len(job.hashes) * self.block_size
        if job.kind == "load":  # this request's own load: vLLM recomputes those tokens
            prov = self._provenance.get(job.req_id or "")
            if prov is not None:
                prov["failed_load_tokens"] = prov.get("failed_load_tokens", 0) + tokens
        elif job.session_id is not None:  # the session's next request is the one to watch
            before = self._failed_copies.get(job.session_id) or 0
            self._failed_copies.put(job.session_id, before + tokens, 64)

    def _complete_offload(self, job: _Job, ok: bool) -> None:
        stall = self._active_stall(job.session_id)
        for h, block, slot in zip(job.hashes, job.device_blocks, job.slots, strict=True):
            if self._filling.get(h) == job.job_id:
                del self._filling[h]
            # The device block was pinned the whole time, so it must still hold this hash; and a
            # demand load that failed meanwhile may have left its KV computed from bad KV (such a
            # block lost its hash then, ``_mark_suspect``, so ``has_hash`` fails too).
            suspect = self._suspect.get(block.block_id, -1) > job.job_id
            if ok and self.pool.has_hash(block, h) and not suspect:
                used = self.host.commit(h, slot)
                if self.decisions is not None:
                    self._note("commit", job=job.job_id, hash=h, slot=used)
                if stall is not None and stall.offloaded:
                    self.host.pin(used, stall_owner(stall.stall_id))
                elif job.stall_id is None and job.session_id and self.policy.uses_events:
                    # An announced stall's save came back before its stall_begin: unpinned, the
                    # copy is the LRU's to reclaim (and its device blocks free to evict) in the
                    # gap, and the stall would find its chain cut. Hold it for the stall.
                    self.host.pin(used, _finish_owner(job.session_id))
                    self._finish_pins[job.session_id] = self.clock() + self.opts.keep_after_end_s
            else:
                if ok:
                    self.stats.inc("offload.suspect_dropped" if suspect else "offload.hash_mismatch")
                self.host.invalidate(slot)

    def _after_offload(self, job: _Job) -> None:
        """The device pins are gone: an offloaded stall whose chain is now all on host is demoted."""
        stall = self._active_stall(job.session_id)
        if stall is not None and stall.offloaded and not self._offload_pending(stall):
            self._demote(stall)

    def _active_stall(self, session_id: str | None) -> _Stall | None:
        sid = self._session_stall.get(session_id or "")
        return self._stalls.get(sid) if sid is not None else None

    def _complete_prefetch(self, job: _Job, ok: bool) -> None:
        if job.session_id is not None and self._prefetching.get(job.session_id) == job.job_id:
            del self._prefetching[job.session_id]
        stall = self._stall(job.stall_id or "")
        published: list[bytes] = []
        if ok and self.pool is not None:
            copied = zip(job.hashes, job.positions, job.device_blocks, job.slots, strict=True)
            for h, pos, block, slot in copied:
                if self.host.hash_of(slot) != h:
                    # A failed load of the same slot dropped it meanwhile ("may be bad"): the
                    # prefetch copied the same bytes, so they are not published either.
                    self.stats.inc("prefetch.source_dropped")
                elif self.pool.register(block, h, (pos + 1) * self.block_size):
                    published.append(h)
                    self._copied[block.block_id] = h
                else:
                    self.stats.inc("prefetch.duplicate_blocks")
        if stall is not None:
            stall.prefetched.extend(published)
        if self.decisions is not None:
            self._note("publish", job=job.job_id, hashes=published)
        if job.stall_id is not None:
            if ok:
                self.planner.mark_done(job.stall_id)
            else:
                self.planner.cancel(job.stall_id, "prefetch_failed")
        self.stats.inc("prefetch.published_blocks", len(published))

    def _hold_prefetched(self, job: _Job) -> None:
        """Keep a prefetched chain on device until its session's request is admitted.

        Unpinned, the uploaded blocks sit in vLLM's free queue and the allocations of the requests
        running meanwhile evict them before the tool returns (a heavy-tailed tool is back long
        after an early prefetch). The hold displaces only idle cached blocks: it yields to any
        request that needs the room to be admitted (``_make_room``), to the running requests'
        next blocks and to a stuck engine (``_tick_keeps``), the latest predicted return first.
        """
        if not self.opts.hold_prefetched or self.pool is None or job.session_id is None:
            return
        stall = self._stall(job.stall_id or "")
        if stall is None or stall.accounted or stall.resumed:
            return  # the request came first (it waited for this copy, or loaded on demand)
        chain = []
        for h in stall.hashes:  # the usable prefix: from block 0, unbroken
            block = self.pool.cached(h)
            if block is None:
                break
            chain.append((0, h, block, None))
        if not chain:
            return
        now = self.clock()
        if stall.ended_at is not None:
            until = stall.ended_at + self.opts.keep_after_end_s
        else:
            until = stall.begin_at + self._expiry(stall.predicted_s)
        self._keep(job.session_id, chain, until, now, rank=stall.returns_at, kind="hold")

    def _complete_load(self, job: _Job, ok: bool) -> None:
        if ok:  # vLLM caches these blocks under their hashes: later hits serve the copied KV
            for h, block in zip(job.hashes, job.device_blocks, strict=True):
                self._copied[block.block_id] = h
        else:
            # The host copy may be bad: drop it so nobody loads it again (vLLM recomputes).
            for h in job.hashes:
                self.host.drop(h)
            first, ids = job.downstream
            self._mark_suspect(job.req_id or "", first, ids)

    def _mark_suspect(self, req_id: str, first: int, block_ids: Sequence[int]) -> None:
        """A demand load of ``req_id`` failed from position ``first``: the failed blocks, and those
        computed from them, hold bad KV under valid hashes. vLLM's ``recompute`` policy (which the
        connector sets) keeps those hashes, trusting the request to recompute the blocks at once;
        a preemption before that, a later chunk, or another request's hit would serve them (and a
        save would commit them to the host). So they leave the prefix cache here (``uncache``: the
        request still recomputes them, they just are not shared afterwards), and a copy of them
        already made is not committed (``_complete_offload``).

        ``block_ids``: the request's blocks from ``first`` on, as allocated at admission. A later
        prefill chunk's blocks (scheduled before the failure was known, with async scheduling)
        are found by the request's own block hashes; a block another request cached under such a
        hash is marked too (conservative: it only stops being shared).
        """
        if self.pool is None:
            return
        marked = [bid for bid in block_ids if self.pool.is_cached(self.pool.block(bid))]
        request = self._admitted.get(req_id)
        hashes = list(getattr(request, "block_hashes", None) or ())
        for pos in range(first + len(block_ids), len(hashes)):
            block = self.pool.cached(bytes(hashes[pos]))
            if block is not None:
                marked.append(block.block_id)
        for bid in marked:
            self._suspect[bid] = self._next_job
        if self.decisions is not None:
            self._note("suspect", req=req_id, blocks=marked)
        if marked:
            self.pool.uncache(marked)
            self.stats.inc("demand_load.uncached_blocks", len(marked))

    def _prune_suspect(self) -> None:
        """Forget marks that no copy in flight was planned before (``_suspect``)."""
        oldest = min(self._jobs, default=self._next_job)
        for bid, mark in list(self._suspect.items()):
            if mark <= oldest:
                del self._suspect[bid]

    def _release(self, job: _Job) -> None:
        """Drop every pin the job holds (device refs and host slot pins), exactly once."""
        if job.released:
            return
        job.released = True
        self.host.release(job.owner)
        # Released ready slots join the host LRU; the chain's head last, so it is reclaimed last.
        self.host.touch(reversed(job.slots))
        if job.kind == "offload":
            for h in job.hashes:
                if self._filling.get(h) == job.job_id:
                    del self._filling[h]
        elif job.kind == "prefetch" and job.session_id is not None:
            if self._prefetching.get(job.session_id) == job.job_id:
                del self._prefetching[job.session_id]
        if job.device_owned and self.pool is not None:
            self.pool.release(job.device_blocks)

    def _timeout_jobs(self, now: float) -> None:
        """Stop waiting for copies the workers have not confirmed in ``job_timeout_s``.

        Nothing waits for them any more (a request stops waiting for its prefetch; the plan is
        cancelled), but their device blocks and host slots stay pinned until the workers report
        them (the handshake: ``release_after_report``) — a copy still running must not write into
        blocks that were handed to someone else. The late report then fails the job.
        """
        for job in list(self._jobs.values()):
            if job.abandoned or now - job.issued_at < self.opts.job_timeout_s:
                continue
            job.abandoned = True
            if self.decisions is not None:
                self._note("timeout", job=job.job_id)
            self.stats.inc("jobs.timed_out")
            age = now - job.issued_at
            log.warning("TokenCake %s job %d unconfirmed after %.0f s", job.kind, job.job_id, age)
            if job.kind == "prefetch":
                if job.session_id is not None and self._prefetching.get(job.session_id) == job.job_id:
                    del self._prefetching[job.session_id]
                if job.stall_id is not None:
                    self.planner.cancel(job.stall_id, "timeout")
        # A given-up copy no longer keeps the engine stepping (a hung one would spin it forever),
        # but its pins go only with its report: step every ABANDONED_POLL_S until it comes.
        abandoned = any(j.abandoned for j in self._jobs.values())
        self._poll_abandoned_at = now + ABANDONED_POLL_S if abandoned else None

    def _disable_copies(self, reason: str) -> None:
        """The workers cannot copy (host pool, KV layout): stop planning jobs that would all fail."""
        self.copies_disabled = reason
        self.opts.offload = self.opts.prefetch = self.opts.demand_load = self.opts.early_save = False
        self.gate.enabled = False
        self.stats.set("worker.copies_disabled", 1)
        log.error("TokenCake: workers cannot copy KV (%s); offload, prefetch and demand load are off", reason)

    def _update_wake_at(self) -> None:
        due = []
        if self.prefetch_enabled:
            due = [
                p.due_at
                for p in self.planner.open_stalls()
                if p.state == "waiting" and math.isfinite(p.due_at)
            ]
        if self._poll_abandoned_at is not None:
            due.append(self._poll_abandoned_at)
        # Retryable gate decisions are not timed: while the engine idles nothing changes for them.
        with self._lock:
            self._wake_at = min(due, default=None)

    # ---- stats
    def _engine_stats(self) -> dict[str, Any]:
        """Runs on the events listener's thread: iterate copies of the engine thread's tables
        (taken in one C call each, atomic under the GIL), never the tables themselves."""
        pool = self.pool
        jobs, kept = tuple(self._jobs.values()), tuple(self._kept.values())
        return {
            "device_blocks": pool.num_blocks if pool is not None else None,
            "device_free_blocks": pool.num_free() if pool is not None else None,
            "jobs_in_flight": len(self._jobs),
            "abandoned_in_flight": sum(j.abandoned for j in jobs),
            "active_stalls": len(self._stalls),
            "demoted_stalls": len(self._demoted),
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "prefetch_enabled": self.prefetch_enabled,
            "demote_enabled": self.demote_enabled,
            "last_eviction_risk": None if self._last_risk is None else round(self._last_risk, 4),
            "alloc_blocks_per_s": round(self._alloc_rate(self.clock()), 3),
            "step_wait_s": round(self._step_wait_s(), 4),
            "kept_sessions": len(self._kept),
            "kept_blocks": sum(len(k.blocks) for k in kept),
        }

    def _config_stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "offload": self.opts.offload,
            "prefetch": self.opts.prefetch,
            "demand_load": self.opts.demand_load,
            "early_save": self.opts.early_save,
            "demote": self.opts.demote,
            "host_pool_blocks": self.host.num_blocks,
        }

    def _bandwidths(self) -> dict[str, float]:
        t = self.transfer.stats()
        return {"d2h": t["d2h_bytes_per_s"], "h2d": t["h2d_bytes_per_s"]}

    def shutdown(self) -> None:
        for job in list(self._jobs.values()):
            self._release(job)
        self._jobs.clear()
        for sid in list(self._kept):
            self._unkeep(sid, "shutdown")
        self.profile.maybe_save(self._bandwidths(), force=True)


__all__ = ["READINESS", "KVCore", "request_meta", "stall_owner"]
