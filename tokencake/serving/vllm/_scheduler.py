"""Scheduler-side half of the connector: the temporal policy acting on vLLM's block pool.

Everything here runs on vLLM's engine thread (inside EngineCore), except :meth:`handle_event`
and :meth:`stats_snapshot`, which the events listener thread calls. The two threads share only
thread-safe objects (``SessionTracker``, ``Stats``, the forecaster) and a wake-up callback; all
block-pool and host-pool mutation happens on the engine thread, in the hooks vLLM calls:

``request_finished``
    remember the session's latest block hashes (prompt + output, full blocks).
``build_connector_meta`` (every step, also empty ones)
    drain stall transitions; at ``stall_begin`` ask the gate and plan the offload (pin the
    cached device blocks, reserve host slots); re-ask retryable decisions while the stall
    lasts; start the prefetches the ``PrefetchPlanner`` says are due (allocate device blocks);
    expire stalls; emit the step's copy jobs for the workers.
``update_connector_output``
    finished copies come back from the workers: commit offloaded blocks to the host index,
    register prefetched blocks in the device prefix cache, release every pin.
``get_num_new_matched_tokens`` / ``update_state_after_alloc``
    demand load: count host-pool hits past the device prefix, map them to the blocks vLLM
    allocated, and plan a synchronous host → device load.

Rules that keep vLLM correct: every device block we pin or allocate is released exactly once
(``_Job.release``); a block is published in the prefix cache only after its copy is confirmed,
and only when no other block serves its hash; a prefetch only brings back blocks that extend an
unbroken chain from block 0; a failed load is reported so vLLM recomputes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from tokencake.events import META_KEY, EventAck, RequestMeta, StallBegin, StallEnd
from tokencake.serving.forecast import DurationForecaster
from tokencake.serving.gate import GateInput, OffloadGate, TransferModel
from tokencake.serving.host_pool import HostPool, HostPoolExhausted
from tokencake.serving.prefetch import PrefetchPlanner, stall_expiry_s
from tokencake.serving.sessions import SessionTracker, StallTransition
from tokencake.serving.stats import Stats
from tokencake.serving.vllm import _blockpool as bp
from tokencake.serving.vllm.metadata import CopyJob, JobKind, TokenCakeMetadata, TokenCakeWorkerMeta

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

log = logging.getLogger("vllm.tokencake")


@dataclass
class Options:
    """Knobs from ``kv_connector_extra_config`` (see ``docs/architecture.md``)."""

    offload: bool = True
    prefetch: bool = True
    demand_load: bool = True
    #: Prefetch starts ``lead = estimated H2D time + prefetch_margin_s`` before the predicted end.
    prefetch_margin_s: float = 0.25
    #: Never let a prefetch take the device below this many free blocks (or any while requests wait).
    prefetch_reserve_blocks: int = 0
    prefetch_reserve_frac: float = 0.10
    #: How often a retryable gate decision (no pressure yet, host full) is asked again.
    reevaluate_s: float = 0.05
    #: Host copies stay pinned this long after ``stall_end`` for the session's next request.
    end_grace_s: float = 30.0
    #: Expiry of a stall without ``stall_end``: clamp(expiry_factor × predicted, min, max).
    expiry_factor: float = 4.0
    expiry_min_s: float = 60.0
    expiry_max_s: float = 3600.0
    #: A copy the workers never confirm is given up after this long (pins released).
    job_timeout_s: float = 60.0
    #: Gate thresholds (see tokencake.serving.gate).
    usage_threshold: float = 0.60
    min_waiting: int = 1


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
    #: True when the device blocks hold a reference taken by us (offload pin, prefetch allocation).
    device_owned: bool = False
    reports: int = 0
    released: bool = False

    @property
    def owner(self) -> str:
        return f"job:{self.job_id}"

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
    offload_job: int | None = None
    next_eval: float = 0.0
    ended_at: float | None = None
    #: The prefetch copy in flight (its timing and state live in the ``PrefetchPlanner``).
    prefetch_job: int | None = None
    #: Blocks published in the device prefix cache by prefetches of this stall.
    prefetched: list[bytes] = field(default_factory=list)
    #: Headroom refusals; a deferred prefetch waits for the next regular step.
    deferred: int = 0
    accounted: bool = False


def _extra_bool(extra: dict[str, Any], name: str, default: bool) -> bool:
    value = extra.get(name, default)
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


def request_meta(request: Request) -> RequestMeta | None:
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


class SchedulerSide:
    """The temporal scheduler's engine-thread state; see the module docstring."""

    def __init__(
        self,
        *,
        block_size: int,
        block_bytes: int,
        num_host_blocks: int,
        num_workers: int = 1,
        device_is_cuda: bool = False,
        options: Options | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.opts = options or Options()
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.num_workers = max(1, num_workers)
        self.clock = clock
        self.host = HostPool(num_host_blocks)
        self.stats = Stats()
        self.forecaster = DurationForecaster()
        self.transfer = TransferModel.for_device(device_is_cuda)
        self.gate = OffloadGate(
            self.transfer,
            enabled=self.opts.offload,
            usage_threshold=self.opts.usage_threshold,
            min_waiting=self.opts.min_waiting,
        )
        self.sessions = SessionTracker(clock=clock)
        self.planner = PrefetchPlanner(
            clock=clock,
            safety_margin_s=self.opts.prefetch_margin_s,
            expiry_factor=self.opts.expiry_factor,
            expiry_min_s=self.opts.expiry_min_s,
            expiry_max_s=self.opts.expiry_max_s,
            unused_after_s=self.opts.end_grace_s,
        )
        self.pool: BlockPool | None = None
        private = bp.check()
        self.private_ok = private is None
        if private is not None and self.opts.prefetch:
            log.warning("TokenCake: predictive prefetch disabled (%s); demand load stays on", private)
        self._wake: Callable[[], None] | None = None
        self._lock = threading.Lock()  # guards _wake_at (listener/timer threads vs engine thread)
        self._wake_at: float | None = None
        self._next_job = 1
        self._jobs: dict[int, _Job] = {}
        self._outbox: list[CopyJob] = []
        self._stalls: dict[str, _Stall] = {}
        self._ended: dict[str, _Stall] = {}
        #: Last ended/expired stall per session (to account the session's next request).
        self._last_stall: dict[str, _Stall] = {}
        #: req_id -> session id of requests carrying TokenCake metadata.
        self._req_session: dict[str, str] = {}
        #: req_id -> (first block, hashes, slots) from the last get_num_new_matched_tokens.
        self._pending_load: dict[str, tuple[int, list[bytes], list[int]]] = {}
        #: req_id -> device prefix-cache hit (tokens) of a session request, for accounting.
        self._local_hit: dict[str, int] = {}
        self._waiting: set[str] = set()
        self._occ: tuple[float, float] = (float("nan"), 0.0)
        self._usa_req: str | None = None
        self._usa_first = 0
        self.stats.register("host_pool", self.host.stats)
        self.stats.register("sessions", self.sessions.stats)
        self.stats.register("forecast", self.forecaster.stats)
        self.stats.register("gate", self.gate.stats)
        self.stats.register("prefetch_plan", self.planner.stats)
        self.stats.register("engine", self._engine_stats)
        self.stats.register("config", self._config_stats)

    # ------------------------------------------------------------ wiring
    def bind_pool(self, pool: BlockPool) -> None:
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
        if self._jobs or self._outbox or self.sessions.stats()["pending_transitions"]:
            return True
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

    def _stall(self, stall_id: str) -> _Stall | None:
        return self._stalls.get(stall_id) or self._ended.get(stall_id)

    def _offload_pending(self, stall: _Stall) -> bool:
        return stall.offload_job is not None and stall.offload_job in self._jobs

    def on_new_request(self, request: Request) -> None:
        meta = request_meta(request)
        if meta is not None:
            self._req_session[request.request_id] = meta.session_id
            self.stats.inc("requests.with_meta")
        self._waiting.add(request.request_id)

    def request_finished(self, request: Request) -> None:
        req_id = request.request_id
        self._waiting.discard(req_id)
        self._pending_load.pop(req_id, None)
        self._local_hit.pop(req_id, None)
        session_id = self._req_session.pop(req_id, None)
        if session_id is None:
            return
        # Full blocks only: the partial tail block is never cached.
        num_full = request.num_computed_tokens // self.block_size
        hashes = [bytes(h) for h in list(request.block_hashes)[:num_full]]
        self.sessions.record_request(session_id, hashes, request.num_computed_tokens, req_id)

    # ---- demand load
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        req_id = request.request_id
        if req_id in self._req_session:
            self._local_hit[req_id] = num_computed_tokens
            # Stall transitions may still be queued (no step since they arrived): apply them now so
            # this request is accounted against its stall. Only bookkeeping and pins happen here.
            self._drain(self.clock())
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

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        self._waiting.discard(req_id)
        pending = self._pending_load.pop(req_id, None)
        local = self._local_hit.pop(req_id, 0)
        self._usa_req, self._usa_first = req_id, (pending[0] if pending else local // self.block_size)
        try:
            self._account_next_turn(request, local, num_external_tokens)
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
        blocks = [self.pool.blocks[b] for b in block_ids[first : first + n]]
        job = self._new_job(
            "load", hashes[:n], list(range(first, first + n)), blocks, slots[:n], req_id=req_id
        )
        self.host.pin_many(job.slots, job.owner)
        self._outbox.append(job.to_wire())
        self.stats.inc("demand_load.requests")
        self.stats.inc("demand_load.blocks", n)
        self.stats.inc("tokens.from_host", n * self.block_size)

    def _account_next_turn(self, request: Request, local: int, external: int) -> None:
        """Prefetch on-time / late / wasted and recomputed prefix tokens for a session's next turn."""
        session_id = self._req_session.get(request.request_id)
        if session_id is None:
            return
        stall = self._last_stall.get(session_id)
        if stall is None or stall.accounted:
            return
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
        self.stats.set("next_turn.last_recomputed", chain_tokens - served)
        self.stats.set("next_turn.last_device", device)
        self.stats.set("next_turn.last_host", served - device)
        # Classify the session's planned stalls: on time only if the whole repeated prefix was on
        # device when the request came (a prefetch or blocks that were never evicted).
        # With prefetch off the planner still tracks the stall (pins, expiry): count apart so the
        # prefetch outcome counters only ever describe prefetches.
        outcome = "prefetch" if self.prefetch_enabled else "no_prefetch"
        for sid, cls in self.planner.on_request(session_id, hit_on_device=local >= chain_tokens):
            self.stats.inc(f"{outcome}.{cls}")
            done = self._stall(sid)
            if cls == "on_time" and done is not None and done.prefetched:
                self.stats.inc("tokens.prefetched_hit", len(done.prefetched) * self.block_size)
            self._release_stall(sid)
        # The next turn has what it needs (loaded, hit or recomputed): unpin the host copies. They
        # stay indexed (LRU-reclaimable) for later hits.
        self._release_stall(stall.stall_id)

    def _release_stall(self, stall_id: str) -> None:
        """Unpin a stall's host copies and forget it (a prefetch in flight keeps its own pins)."""
        self.host.release(stall_id)
        self._ended.pop(stall_id, None)

    # ---- per step
    def build_meta(self) -> TokenCakeMetadata:
        try:
            self._step(self.clock())
        except Exception:  # policy failure: skip this step's policy work, still ship planned loads
            self.stats.inc("errors.step")
            log.exception("TokenCake: step failed")
        jobs = self.flush()
        if jobs:
            self.stats.inc("steps.with_jobs")
        return TokenCakeMetadata(jobs)

    def flush(self) -> list[CopyJob]:
        """Hand over the planned copies (demand loads must reach the workers this very step)."""
        jobs, self._outbox = self._outbox, []
        return jobs

    def fail_load(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Last resort when planning a demand load failed: make the workers report it failed."""
        first = self._usa_first if self._usa_req == request.request_id else 0
        n = -(-num_external_tokens // self.block_size)
        ids = block_ids[first : first + n] if block_ids else []
        self.stats.inc("demand_load.plan_failed")
        self._outbox.append(CopyJob(0, "load", list(ids), [], request.request_id, invalid=True))

    def _step(self, now: float) -> None:
        self._drain(now)
        for stall in list(self._stalls.values()):
            try:
                self._tick_stall(stall, now)
            except Exception:
                self.stats.inc("errors.tick")
                log.exception("TokenCake: stall %s tick failed", stall.stall_id)
        if self.prefetch_enabled:
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
        for sid in self.planner.expired(now):
            # No end in time, or ended long ago without a next request: release the host pins.
            stall = self._stalls.pop(sid, None)
            if stall is not None:
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
            )
            self.stats.inc(f"forecast.source.{fc.source}")
            self._stalls[stall.stall_id] = stall
            self._evaluate(stall, now)
        elif tr.kind == "end":
            stall = self._stalls.pop(tr.stall_id, None)
            ev = tr.event
            if stall is None:
                return
            stall.ended_at = tr.at
            if isinstance(ev, StallEnd):
                self.forecaster.observe(stall.agent_type, stall.tool, ev.duration_s, stall.predicted_s)
                self.stats.observe("forecast.error_s", stall.predicted_s - ev.duration_s)
            self._finish_stall(stall)
            plan = self.planner.get(stall.stall_id)
            if plan is not None and plan.state in ("waiting", "on_device"):
                if plan.state == "on_device" and not self._chain_on_device(stall):
                    # A stall longer than predicted: what was prefetched (or still cached) at the
                    # due time was evicted since; the planner makes it due again at the end.
                    self.planner.mark_evicted(stall.stall_id)
                elif plan.state == "waiting" and plan.due_at > tr.at:
                    self.stats.inc("prefetch.triggered_by_end")  # an end earlier than predicted
                self.planner.end(stall.stall_id, now=tr.at)
            elif plan is not None:
                self.planner.end(stall.stall_id, now=tr.at)
        else:  # expired by the tracker's safety net
            stall = self._stalls.pop(tr.stall_id, None)
            if stall is not None:
                self._expire(stall, tr.detail or "expired")

    def _finish_stall(self, stall: _Stall) -> None:
        self.stats.inc(f"stalls.final_decision.{stall.decision or 'undecided'}")
        self._ended[stall.stall_id] = stall
        self._last_stall.pop(stall.session_id, None)
        self._last_stall[stall.session_id] = stall
        while len(self._last_stall) > 4096:
            self._last_stall.pop(next(iter(self._last_stall)))
        if stall.decision is not None:
            self.sessions.set_decision(stall.stall_id, stall.decision)

    def _evaluate(self, stall: _Stall, now: float) -> None:
        """Ask the gate; on yes pin the device chain and plan the device → host copy."""
        pool = self.pool
        if pool is None:
            return
        chain: list[tuple[int, bytes, KVCacheBlock | None, int | None]] = []
        for i, h in enumerate(stall.hashes):
            dev = bp.cached_block(pool, h)
            slot = self.host.lookup(h)
            if dev is None and slot is None:
                break  # a hit needs an unbroken chain from block 0: the rest is useless
            chain.append((i, h, dev, slot))
        num_on_host = sum(1 for c in chain if c[3] is not None)
        decision = self.gate.decide(
            GateInput(
                predicted_s=stall.predicted_s,
                num_blocks=len(chain),
                block_bytes=self.block_bytes,
                device_usage=self._occupancy(pool, now),
                num_waiting=len(self._waiting),
                host_free_blocks=self.host.num_free,
                num_on_host=num_on_host,
                host_reclaimable_blocks=self.host.num_reclaimable,
                elapsed_s=max(0.0, now - stall.begin_at),
                session_known=stall.known,
            )
        )
        first = stall.decision is None
        if not first and decision.reason == "no_blocks":
            # The blocks were evicted while we waited for pressure or room: keep the reason we were
            # waiting for (that is why nothing was offloaded) and stop asking.
            self.stats.inc(f"stalls.lost_while_waiting.{stall.decision}")
            stall.next_eval = float("inf")
            return
        stall.decision = decision.reason
        if first:
            self.stats.inc(f"stalls.decision.{decision.reason}")
        self.sessions.set_decision(stall.stall_id, decision.reason)
        if not decision.offload:
            stall.next_eval = now + self.opts.reevaluate_s if decision.retryable else float("inf")
            return
        stall.next_eval = float("inf")
        # Host copies that already exist (an earlier turn's prefix) just get pinned for this stall.
        for _i, _h, _dev, slot in chain:
            if slot is not None:
                self.host.pin(slot, stall.stall_id)
        todo = [(i, h, dev) for i, h, dev, slot in chain if slot is None and dev is not None]
        if todo:
            try:
                slots = self.host.allocate(len(todo), stall.stall_id)
            except HostPoolExhausted:
                stall.decision = "host_pool_full"
                self.stats.inc("stalls.decision.host_pool_full_at_alloc")
                self.host.release(stall.stall_id)
                return
            blocks = [dev for _i, _h, dev in todo if dev is not None]
            bp.pin(pool, blocks)
            job = self._new_job(
                "offload",
                [h for _i, h, _d in todo],
                [i for i, _h, _d in todo],
                blocks,
                slots,
                stall_id=stall.stall_id,
            )
            job.device_owned = True
            stall.offload_job = job.job_id
            self._outbox.append(job.to_wire())
            self.stats.inc("offload.jobs")
        stall.offloaded = True
        h2d = self.transfer.estimate("h2d", len(chain) * self.block_bytes)
        self.planner.begin(stall.stall_id, stall.session_id, stall.predicted_s, h2d, now=stall.begin_at)
        if not first:
            self.stats.inc("stalls.offload_after_retry")

    def _occupancy(self, pool: BlockPool, now: float) -> float:
        """``bp.occupancy`` computed at most once per step (it is O(num_blocks))."""
        if self._occ[0] != now:
            self._occ = (now, bp.occupancy(pool))
        return self._occ[1]

    def _tick_stall(self, stall: _Stall, now: float) -> None:
        if stall.next_eval <= now and stall.ended_at is None:
            self._evaluate(stall, now)
        expiry = stall_expiry_s(
            stall.predicted_s,
            factor=self.opts.expiry_factor,
            min_s=self.opts.expiry_min_s,
            max_s=self.opts.expiry_max_s,
        )
        if not stall.offloaded and now - stall.begin_at >= expiry:  # offloaded: the planner expires it
            self._stalls.pop(stall.stall_id, None)
            self.sessions.expire(stall.stall_id, "no_stall_end")
            self._expire(stall, "no_stall_end")

    def _expire(self, stall: _Stall, reason: str) -> None:
        self.stats.inc(f"stalls.expired.{reason}")
        self.planner.cancel(stall.stall_id, "expired")
        self._release_stall(stall.stall_id)

    def _expire_ended(self, now: float) -> None:
        # Stalls the planner does not know (never offloaded) are forgotten after the grace period.
        for sid, stall in list(self._ended.items()):
            if stall.offloaded or stall.ended_at is None:
                continue
            if now - stall.ended_at >= self.opts.end_grace_s:
                self._release_stall(sid)

    # ---- prefetch
    def _chain_on_device(self, stall: _Stall) -> bool:
        """Whether every block of the stall's chain that has a host copy is cached on device."""
        if self.pool is None:
            return False
        for h in stall.hashes:
            if bp.cached_block(self.pool, h) is None and self.host.lookup(h) is not None:
                return False
        return True

    def _try_prefetch(self, stall: _Stall, now: float) -> None:
        """Bring the stall's missing chain blocks back into the device prefix cache (planner: due)."""
        pool = self.pool
        if pool is None or self._offload_pending(stall):
            return  # stays due: retried once the offload is confirmed
        need: list[tuple[int, bytes, int]] = []
        for i, h in enumerate(stall.hashes):
            if bp.cached_block(pool, h) is not None:
                continue
            slot = self.host.lookup(h)
            if slot is None:
                break  # a hit needs an unbroken chain from block 0
            need.append((i, h, slot))
        if not need:
            # Everything is still cached on device: nothing to copy (the end re-checks).
            self.planner.mark_started(stall.stall_id, now=now)
            self.planner.mark_done(stall.stall_id, now=now)
            self.stats.inc("prefetch.not_needed")
            return
        reserve = max(
            self.opts.prefetch_reserve_blocks, int(self.opts.prefetch_reserve_frac * pool.num_gpu_blocks)
        )
        if self._waiting or bp.num_free(pool) - len(need) < reserve:
            if stall.deferred == 0:
                self.stats.inc(
                    "prefetch.deferred.headroom" if not self._waiting else "prefetch.deferred.waiting"
                )
            stall.deferred += 1
            return
        blocks = bp.allocate(pool, len(need))
        job = self._new_job(
            "prefetch",
            [h for _i, h, _s in need],
            [i for i, _h, _s in need],
            blocks,
            [s for *_x, s in need],
            stall_id=stall.stall_id,
        )
        job.device_owned = True
        self.host.pin_many(job.slots, job.owner)
        stall.prefetch_job = job.job_id
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
    ) -> _Job:
        job = _Job(
            self._next_job, kind, hashes, positions, blocks, list(slots), self.clock(), stall_id, req_id
        )
        self._next_job += 1
        self._jobs[job.job_id] = job
        return job

    def on_worker_meta(self, meta: TokenCakeWorkerMeta | None) -> None:
        if meta is None:
            return
        for job_id, res in meta.results.items():
            job = self._jobs.get(job_id)
            if job is None:
                continue
            job.reports += res.workers
            if not res.ok:
                job.reports = max(job.reports, self.num_workers)
                self._complete(job, ok=False, seconds=res.seconds, error=res.error)
            elif job.reports >= self.num_workers:
                self._complete(job, ok=True, seconds=res.seconds, error=None)

    def _complete(self, job: _Job, *, ok: bool, seconds: float, error: str | None) -> None:
        self._jobs.pop(job.job_id, None)
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
        try:
            if kind == "offload":
                self._complete_offload(job, ok)
            elif kind == "prefetch":
                self._complete_prefetch(job, ok)
            else:
                self._complete_load(job, ok)
        finally:
            self._release(job)

    def _complete_offload(self, job: _Job, ok: bool) -> None:
        for h, block, slot in zip(job.hashes, job.device_blocks, job.slots, strict=True):
            # The device block was pinned the whole time, so it must still hold this hash.
            if ok and bp.has_hash(block, h):
                self.host.commit(h, slot)
            else:
                if ok:
                    self.stats.inc("offload.hash_mismatch")
                self.host.invalidate(slot)

    def _complete_prefetch(self, job: _Job, ok: bool) -> None:
        stall = self._stalls.get(job.stall_id or "") or self._ended.get(job.stall_id or "")
        published: list[bytes] = []
        if ok and self.pool is not None:
            for h, pos, block in zip(job.hashes, job.positions, job.device_blocks, strict=True):
                if bp.register(self.pool, block, h, (pos + 1) * self.block_size):
                    published.append(h)
                else:
                    self.stats.inc("prefetch.duplicate_blocks")
        if stall is not None:
            stall.prefetched.extend(published)
        if job.stall_id is not None:
            if ok:
                self.planner.mark_done(job.stall_id)
            else:
                self.planner.cancel(job.stall_id, "prefetch_failed")
        self.stats.inc("prefetch.published_blocks", len(published))

    def _complete_load(self, job: _Job, ok: bool) -> None:
        if not ok:
            # The host copy may be bad: drop it so nobody loads it again (vLLM recomputes).
            for h in job.hashes:
                self.host.drop(h)

    def _release(self, job: _Job) -> None:
        """Drop every pin the job holds (device refs and host slot pins), exactly once."""
        if job.released:
            return
        job.released = True
        self.host.release(job.owner)
        if job.device_owned and self.pool is not None:
            bp.release(self.pool, job.device_blocks)

    def _timeout_jobs(self, now: float) -> None:
        for job in list(self._jobs.values()):
            if now - job.issued_at >= self.opts.job_timeout_s:
                self.stats.inc("jobs.timed_out")
                self._complete(job, ok=False, seconds=0.0, error="no confirmation from the workers")

    def _update_wake_at(self) -> None:
        due = []
        if self.prefetch_enabled:
            due = [p.due_at for p in self.planner.open_stalls() if p.state == "waiting"]
        # Retryable gate decisions are not timed: while the engine idles nothing changes for them.
        with self._lock:
            self._wake_at = min(due, default=None)

    # ---- stats
    def _engine_stats(self) -> dict[str, Any]:
        pool = self.pool
        return {
            "device_blocks": pool.num_gpu_blocks if pool is not None else None,
            "device_free_blocks": bp.num_free(pool) if pool is not None else None,
            "jobs_in_flight": len(self._jobs),
            "active_stalls": len(self._stalls),
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "prefetch_enabled": self.prefetch_enabled,
        }

    def _config_stats(self) -> dict[str, Any]:
        return {
            "offload": self.opts.offload,
            "prefetch": self.opts.prefetch,
            "demand_load": self.opts.demand_load,
            "host_pool_blocks": self.host.num_blocks,
        }

    def shutdown(self) -> None:
        for job in list(self._jobs.values()):
            self._release(job)
        self._jobs.clear()


__all__ = ["Options", "SchedulerSide", "request_meta"]
