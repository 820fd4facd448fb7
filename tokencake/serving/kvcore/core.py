"""``KVCore``: the KV mechanism's front — wiring, the step driver, and one line per hook handed to
the component that owns the rule (see ``docs/architecture.md``, "The KV core and its two backends").
The hooks are vLLM's connector hooks; the simulator calls them in vLLM's order too.

In the vLLM backend all of it runs on the engine thread (inside EngineCore), except :meth:`handle_event`
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
    register prefetched blocks in the device prefix cache, release every pin — each once every
    rank reported the copy. A failed demand load acts at the first rank's word instead (its
    failed result, or its blocks in vLLM's ``invalid_block_ids``). Once a stalled
    session's chain is safely on host, its idle device blocks move to the *front* of vLLM's
    eviction queue (latest predicted return first), and back to the end when its prefetch falls
    due or the tool returns.
``admit`` (TokenCake's scheduler, before vLLM's own admission test)
    admission control: release the held chains a waiting request needs the blocks of, or have it
    wait this pass (vLLM skips it and looks at the next one) for room kept ahead of returns, the
    critical reserve, or a running request that held chains just gave their blocks to — each
    wait bounded (``tokencake.serving.admission``). Without that scheduler nothing is held back.
``get_num_new_matched_tokens`` / ``update_state_after_alloc``
    demand load: count host-pool hits past the device prefix, map them to the blocks vLLM
    allocated, and plan a synchronous host → device load. A request whose prefetch is still
    being copied waits one step for it instead of loading the same blocks twice; one whose
    device prefix hit includes blocks of a load not confirmed yet waits for the load's result.
``reset_cache`` (also after a device-only reset, which the vLLM binding detects)
    vLLM reset its prefix cache (weights changed): drop every host copy, ignore copies in flight
    — also after a device-only reset, which vLLM does not pass on to the connector.

Rules that keep vLLM correct: every device block we pin or allocate is released exactly once
(``_Job.release``); offloads are copied after the step's forward (the worker runs them in
``wait_for_save``: a block hashed this step holds its KV only then); a block is published in
the prefix cache only after its copy is confirmed, and only when no other block serves its hash;
a prefetch only brings back blocks that extend an unbroken chain from block 0; a failed load is
reported so vLLM recomputes, and its blocks leave the prefix cache in the step the first rank's
report of it arrives; no other request hits a load's blocks before its result is known;
nothing from before a ``reset_cache`` or a device prefix-cache reset is committed, published
or served.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterable
from functools import partial
from typing import Any

from tokencake.events import EventAck, StallBegin, StallEnd
from tokencake.serving.forecast import DurationForecaster
from tokencake.serving.gate import OffloadGate, TransferModel
from tokencake.serving.host_pool import HostPool
from tokencake.serving.kvcore.admission_control import AdmissionControl
from tokencake.serving.kvcore.copies import CopyJobs
from tokencake.serving.kvcore.critical import CriticalWatch
from tokencake.serving.kvcore.demand import DemandLoad
from tokencake.serving.kvcore.engine_stats import config_stats, engine_stats
from tokencake.serving.kvcore.eviction import EvictionOrder
from tokencake.serving.kvcore.holds import Holds
from tokencake.serving.kvcore.lifecycle import StallLifecycle
from tokencake.serving.kvcore.offload import OffloadPlanning
from tokencake.serving.kvcore.ports import DevicePool, RequestView
from tokencake.serving.kvcore.readiness import Readiness
from tokencake.serving.kvcore.records import READINESS, request_meta, stall_owner
from tokencake.serving.kvcore.requests import RequestBook
from tokencake.serving.kvcore.stalls import StallBook
from tokencake.serving.kvcore.steps import StepHistory
from tokencake.serving.kvcore.uploads import Uploads
from tokencake.serving.kvcore.wire import CopyJob, CopyReport
from tokencake.serving.options import Options
from tokencake.serving.policies import KVPolicy, make_policy
from tokencake.serving.prefetch import PrefetchPlanner
from tokencake.serving.profile import PrefillProfile
from tokencake.serving.sessions import SessionTracker
from tokencake.serving.stats import Stats
from tokencake.serving.transparent import TRANSPARENT_NODE

log = logging.getLogger("vllm.tokencake")


class KVCore:
    """The KV mechanism's engine-thread state; see the module docstring."""

    #: Among demoted chains, critical-path sessions' are evicted last. The spatial scheduler
    #: (``scheduler.py``) turns this on when it takes over admission; off, the order is by
    #: predicted return only, as measured for the default server.
    critical_last: bool = False
    #: TokenCake's scheduler applies :meth:`admit` in vLLM's admission loop
    #: (:meth:`enable_admission_control`); off, nothing holds an admission back (see :meth:`admit`).
    admission_control: bool = False
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
        full_sequence_must_fit: bool = True,
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
        #: run, this share of the device left free (``--watermark``): ``make_room`` counts both.
        self.lookahead_tokens = max(0, int(lookahead_tokens))
        self.watermark = max(0.0, float(watermark))
        #: vLLM admits a request only if its whole prompt fits (``scheduler_reserve_full_isl``),
        #: else if this step's chunk does.
        self.full_sequence_must_fit = bool(full_sequence_must_fit)
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
        #: Room kept ahead of returns (``Options.return_reserve``; "auto": on where copies run on
        #: CUDA side streams beside the forward) and, per step, session -> blocks kept for it.
        self.reserves_returns = self.opts.reserves_returns(copies_beside_compute=device_is_cuda)
        self.requests = RequestBook(self)
        self.demand = DemandLoad(self)
        self.stalls = StallBook(self)
        self.lifecycle = StallLifecycle(self)
        self.offload = OffloadPlanning(self)
        self.holds = Holds(self)
        self.admission = AdmissionControl(self)
        self.critical = CriticalWatch(self)
        self.readiness = Readiness(self)
        self.steps = StepHistory(self)
        self.eviction = EvictionOrder(self)
        self.uploads = Uploads(self)
        self.copies = CopyJobs(self)
        self.stats.register("host_pool", self.host.stats)
        self.stats.register("sessions", self.sessions.stats)
        self.stats.register("forecast", self.forecaster.stats)
        self.stats.register("gate", self.gate.stats)
        self.stats.register("prefetch_plan", self.planner.stats)
        self.stats.register("policy", self.policy.stats)
        self.stats.register("profile", self.profile.stats)
        self.stats.register("engine", partial(engine_stats, self))
        self.stats.register("config", partial(config_stats, self))

    def note(self, what: str, **fields: Any) -> None:
        """Record one decision (callers check ``decisions is not None`` first: nothing when off)."""
        assert self.decisions is not None
        self.decisions.append({"t": self.clock(), "what": what, **fields})

    def bind_pool(self, pool: DevicePool) -> None:
        self.pool = pool

    def set_wake(self, wake: Callable[[], None] | None) -> None:
        """A thread-safe callback that makes an idle engine run one step (None: none available)."""
        self._wake = wake

    def enable_admission_control(self, running_need: Callable[[], int] | None = None) -> None:
        """TokenCake's scheduler asks :meth:`admit` about every waiting request vLLM looks at;
        ``running_need``: the blocks vLLM's running requests still need this step (what held
        chains yield to them at once, :meth:`free_for_running`)."""
        self.admission_control = True
        self.holds.running_need = running_need

    def _poke(self) -> None:
        if self._wake is not None:
            try:
                self._wake()
            except Exception:
                self.stats.inc("errors.wake")

    def handle_event(self, event: StallBegin | StallEnd) -> EventAck:
        """Record one event (bookkeeping only) and wake the engine; called off the engine thread."""
        ack = self.sessions.apply(event)
        self.stats.inc(f"events.{event.type}")
        self.stats.inc(f"acks.{ack.status if ack.ok else ack.reason}")
        if event.node == TRANSPARENT_NODE and ack.status == "recorded":
            # The tool calls that transparent mode derived for plain OpenAI clients.
            kind = "begin" if event.type == "stall_begin" else "end"
            self.stats.inc(f"events.transparent_{kind}")
        if ack.ok and ack.status == "recorded":
            self._poke()
        return ack

    def stats_snapshot(self) -> dict[str, Any]:
        return self.stats.snapshot()

    def next_wake_at(self) -> float | None:
        """Monotonic time when the engine must step for a timed prefetch (for the waker thread)."""
        with self._lock:
            return self._wake_at

    def has_pending_work(self) -> bool:
        """True while copies are in flight, transitions wait, or a prefetch is due now."""
        live = any(not j.abandoned for j in self.copies.jobs.values())
        if live or self.copies.outbox or self.sessions.pending_transitions():
            return True
        if self.copies.poll_abandoned_at is not None and self.clock() >= self.copies.poll_abandoned_at:
            return True  # a given-up copy's late report releases its pins: poll for it now and then
        if not self.prefetch_enabled:
            return False
        # A prefetch deferred for headroom is retried at the next regular step; it must not keep an
        # otherwise idle engine spinning.
        for sid in self.planner.due(self.clock()):
            stall = self.stalls.get(sid)
            if stall is not None and not stall.deferred and not self.copies.offload_pending(stall):
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
        return session_id in self.holds.kept

    def saved_kv(self, session_id: str) -> bool:
        """Whether at least half of the session's latest chain is on host from its head: its next
        request resumes with a load (the spatial score's ``saved_s``). Pinned or not: copies an
        offloaded stall pins stay pinned while the request waits; others are the LRU's."""
        stall = self.stalls.active_of(session_id) or self.stalls.last.get(session_id)
        return stall is not None and self.host.saves_most_of(stall.hashes)

    def on_new_request(self, request: RequestView) -> None:
        """A request arrived (:meth:`RequestBook.on_new_request`)."""
        self.requests.on_new_request(request)

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> int | None:
        """Host-pool hits past the device prefix, or None: ask again next step
        (:meth:`RequestBook.matched_tokens`)."""
        return self.requests.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """vLLM allocated the request's blocks (:meth:`RequestBook.allocated`)."""
        self.holds.counts.forget()  # its prefix hits were referenced (``HoldCounts``)
        self.requests.allocated(request, block_ids, num_external_tokens)

    def request_finished(self, request: RequestView) -> dict[str, Any] | None:
        """The request finished; where its prompt KV came from (:meth:`RequestBook.finished`)."""
        return self.requests.finished(request)

    # ---- hooks handed to the component that owns them
    def admit(self, request: RequestView, num_running: int) -> bool:
        """TokenCake's scheduler asks before vLLM's admission test (:class:`AdmissionControl`)."""
        return self.admission.admit(request, num_running)

    def free_for_running(self) -> bool:
        """vLLM is about to preempt a running request (:meth:`Holds.free_for_running`)."""
        return self.holds.free_for_running()

    def release_device_holds(self) -> int:
        """vLLM is about to reset its prefix cache (:meth:`Holds.release_device_holds`)."""
        return self.holds.release_device_holds()

    def reserved_blocks(self) -> int:
        """Device blocks held for critical-path sessions now (:meth:`Holds.reserved_blocks`)."""
        return self.holds.reserved_blocks()

    def observe_step(
        self,
        num_scheduled_tokens: int,
        now: float | None = None,
        *,
        num_running: int = 0,
        preempted: Iterable[str] = (),
    ) -> None:
        """One engine step's scheduled tokens, running and preempted requests (:class:`StepHistory`)."""
        self.holds.counts.forget()  # the pass ended (``HoldCounts``)
        self.steps.observe_step(num_scheduled_tokens, now, num_running=num_running, preempted=preempted)

    def on_worker_meta(self, meta: CopyReport | None, invalid_block_ids: Collection[int] = ()) -> None:
        """The copy engines' reports (:meth:`CopyJobs.on_worker_meta`)."""
        self.copies.on_worker_meta(meta, invalid_block_ids)

    def flush(self) -> list[CopyJob]:
        """The copies planned since the last call (:meth:`CopyJobs.flush`)."""
        return self.copies.flush()

    def device_copies_in_flight(self) -> int:
        """Copy jobs that still pin device blocks (:meth:`CopyJobs.device_copies_in_flight`)."""
        return self.copies.device_copies_in_flight()

    def fail_load(self, request: RequestView, block_ids: list[int], num_external_tokens: int) -> None:
        """Planning a demand load failed (:meth:`DemandLoad.fail_load`)."""
        self.demand.fail_load(request, block_ids, num_external_tokens)

    def build_jobs(self) -> list[CopyJob]:
        """Run the step's policy work and hand over the copies planned since the last call."""
        self.holds.counts.forget()  # the pass ended (``HoldCounts``)
        try:
            self._step(self.clock())
        except Exception:  # policy failure: skip this step's policy work, still ship planned loads
            self.stats.inc("errors.step")
            log.exception("TokenCake: step failed")
        jobs = self.copies.flush()
        if jobs:
            self.stats.inc("steps.with_jobs")
        return jobs

    def reset_cache(self) -> bool:
        """vLLM reset its prefix cache (new weights): forget every host copy; copies in flight
        commit nothing; live stalls whose offload relied on the dropped copies are decided again
        (:meth:`StallLifecycle.reopen_after_reset`), so the chain computed under the new weights
        can be saved.

        The generation and the host pool go first: should anything after them raise, nothing
        from before the reset is committed or served (and the vLLM binding runs it again)."""
        if self.decisions is not None:
            self.note("reset")
        self.copies.generation += 1
        dropped = self.host.reset()
        self.demand.copied.clear()
        self.copies.suspect.clear()  # no hash survives the reset
        self.copies.filling.clear()
        self.eviction.demoted.clear()
        self.holds.release_device_holds()
        for sid in list(self.stalls.finish_pins):
            self.stalls.release_finish_pins(sid)
        self.lifecycle.reopen_after_reset(self.clock())
        self.stats.inc("reset.count")
        self.stats.inc("reset.host_blocks_dropped", dropped)
        log.info("TokenCake: prefix cache reset, %d host blocks dropped", dropped)
        return True

    def _step(self, now: float) -> None:
        if now >= self.stalls.next_sweep:  # the tracker's safety net: old stalls, idle sessions
            self.stalls.next_sweep = now + 1.0
            self.sessions.sweep(now)
            for sid, deadline in list(self.stalls.finish_pins.items()):
                if deadline <= now:  # announced, but no stall came: the copies are the LRU's again
                    self.stalls.release_finish_pins(sid)
                    self.stats.inc("early_save.pins_expired")
        self.lifecycle.drain(now)
        self.critical.before = None  # a snapshot holds within one scheduling pass only
        if self.requests.first_token:
            self.requests.watch_first_tokens(now)
        waiting = bool(self.requests.waiting)
        if waiting and not self.lifecycle.was_waiting:
            self.lifecycle.ask_backed_off_now(now)
        self.lifecycle.was_waiting = waiting
        if self.holds.kept:
            self.holds.tick_keeps(now)
        if self.critical_last and self.pool is not None:
            reserved = self.holds.reserved_blocks()  # the reserve in use, every step: its ratio over time
            self.stats.set("spatial.reserved_blocks", reserved)
            self.stats.observe("spatial.reserved_frac", reserved / max(self.pool.num_blocks, 1))
            self.stats.inc("spatial.reserved_block_steps", reserved)  # Prometheus: ratio over time
            self.stats.inc("spatial.steps")
        self.profile.maybe_save(self._bandwidths())
        self.admission.returning = self.admission.reserve_returns(now)
        for stall in list(self.stalls.active.values()):
            try:
                self.lifecycle.tick_stall(stall, now)
            except Exception:
                self.stats.inc("errors.tick")
                log.exception("TokenCake: stall %s tick failed", stall.stall_id)
        if self.prefetch_enabled:
            self.uploads.recheck_prefetched(now)
            for sid in self.planner.due(now):
                stall = self.stalls.get(sid)
                if stall is None:
                    self.planner.cancel(sid, "stall_forgotten")
                    continue
                try:
                    self.uploads.try_prefetch(stall, now)
                except Exception:
                    self.stats.inc("errors.prefetch")
                    self.planner.cancel(sid, "error")
                    log.exception("TokenCake: prefetch for %s failed", sid)
            for sid in list(self.uploads.topups):
                try:
                    self.uploads.try_topup(sid, now)
                except Exception:
                    self.uploads.topups.pop(sid, None)
                    self.stats.inc("errors.prefetch")
                    log.exception("TokenCake: prefetch top-up for %s failed", sid)
        for sid in self.planner.expired(now):
            # No end in time, or ended long ago without a next request: release the host pins.
            stall = self.stalls.active.get(sid)
            if stall is not None:
                self.lifecycle.expire_calls(stall, list(stall.calls.open), "no_stall_end")
            self.stalls.release(sid)
        self.stalls.expire_ended(now)
        self.copies.timeout_jobs(now)
        self._update_wake_at()

    def _update_wake_at(self) -> None:
        due = []
        if self.prefetch_enabled:
            due = [
                p.due_at
                for p in self.planner.open_stalls()
                if p.state == "waiting" and math.isfinite(p.due_at)
            ]
        if self.copies.poll_abandoned_at is not None:
            due.append(self.copies.poll_abandoned_at)
        # Retryable gate decisions are not timed: while the engine idles nothing changes for them.
        with self._lock:
            self._wake_at = min(due, default=None)

    def _bandwidths(self) -> dict[str, float]:
        t = self.transfer.stats()
        return {"d2h": t["d2h_bytes_per_s"], "h2d": t["h2d_bytes_per_s"]}

    def shutdown(self) -> None:
        for job in list(self.copies.jobs.values()):
            self.copies.release(job)
        self.copies.jobs.clear()
        for sid in list(self.holds.kept):
            self.holds.unkeep(sid, "shutdown")
        self.profile.maybe_save(self._bandwidths(), force=True)


__all__ = ["READINESS", "KVCore", "request_meta", "stall_owner"]
