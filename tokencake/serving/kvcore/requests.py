"""Requests the core knows of and their lifecycle as vLLM reports it (arrival, prefix match,
allocation, finish): their metadata, the queue's KV demand, arrival and first-look times, resumed
turns awaiting their first token.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from tokencake.serving.kvcore.ports import RequestView
from tokencake.serving.kvcore.records import ReqInfo, request_meta

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

log = logging.getLogger("vllm.tokencake")


class RequestBook:
    """Requests the core knows of (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core
        #: req_id -> what we know of requests carrying TokenCake metadata.
        self.info: dict[str, ReqInfo] = {}
        #: Requests not yet admitted -> blocks their prompt needs (the queue's KV demand).
        self.waiting: dict[str, int] = {}
        #: Admitted requests not finished yet (a preempted one goes back to ``waiting``).
        self.admitted: dict[str, RequestView] = {}
        #: Resumed turns (a session's request after its tool call) waiting for their first token:
        #: request and arrival, for the ``next_turn.ttft_s`` histogram.
        self.first_token: dict[str, tuple[RequestView, float]] = {}
        #: Request id -> arrival time (the queueing delay policies learn from).
        self.arrival: dict[str, float] = {}
        #: Request id -> when vLLM's admission first looked at it (the head of the queue), until
        #: admitted (a preempted request's next admission starts a new look): the clock of
        #: ``admission_wait_s``, and the critical reserve's with ``critical_reserve_wait_from = "head"``.
        self.first_look: dict[str, float] = {}

    def waiting_sessions(self) -> set[str]:
        """Sessions with a request queued for admission."""
        return {info.session_id for rid in self.waiting if (info := self.info.get(rid)) is not None}

    def reserve_waited(self, req_id: str) -> float:
        """How long the request has waited by the critical reserve's clock
        (``critical_reserve_wait_from``): since it arrived, or since vLLM's admission first looked
        at it (the head of the queue: queueing that delays every request does not count). inf for
        a re-admission (a preempted request): the reserve never holds it back."""
        arrived = self.arrival.get(req_id)
        if arrived is None:
            return math.inf
        if self.core.opts.critical_reserve_wait_from == "head":
            arrived = self.first_look.get(req_id, arrived)
        return max(self.core.clock() - arrived, 0.0)

    def look(self, req_id: str) -> None:
        """vLLM's admission looks at the request (the first look starts its wait clocks)."""
        if req_id not in self.first_look:
            self.first_look[req_id] = self.core.clock()

    def watch_first_tokens(self, now: float, finished: str | None = None) -> None:
        """Time to first token of resumed turns: what the user of an agent waits after its tool."""
        for req_id, (request, arrived) in list(self.first_token.items()):
            if getattr(request, "num_output_tokens", 0) > 0:
                self.core.stats.observe("next_turn.ttft_s", now - arrived)
            elif req_id != finished:
                continue  # still queued or in prefill
            del self.first_token[req_id]

    def forget(self, req_id: str) -> tuple[ReqInfo | None, bool]:
        """The request finished or was aborted: drop it everywhere; returns its metadata and
        whether it was never admitted (still queued)."""
        self.waiting.pop(req_id, None)
        self.admitted.pop(req_id, None)
        if self.first_token:
            self.watch_first_tokens(self.core.clock(), finished=req_id)
        never_admitted = self.arrival.pop(req_id, None) is not None
        self.first_look.pop(req_id, None)
        return self.info.pop(req_id, None), never_admitted

    def on_new_request(self, request: RequestView) -> None:
        meta = request_meta(request)
        if meta is not None:
            self.info[request.request_id] = ReqInfo(
                meta.session_id,
                meta.agent_type or meta.node,
                meta.next_stall,
                meta.graph.on_critical_path,
                derive_stalls=not meta.stall_events,
                run_id=meta.run_id,
                node=meta.node,
                slack_s=max(float(meta.graph.slack_s), 0.0),
            )
            self.core.stats.inc("requests.with_meta")
            if not meta.stall_events:
                self.core.stalls.end_derived_stall(meta.session_id)
            elif meta.session_id in self.core.stalls.by_session:
                self.core.lifecycle.drain(self.core.clock())  # its end, if delivered, is usually still queued
                self.core.stalls.end_stalls_the_request_outlived(meta.session_id)
            # Its stalls' host copies are what this request loads next: keep them pinned while
            # it waits for admission, however long the queue (PrefetchPlanner.on_waiting).
            self.core.planner.on_waiting(meta.session_id, now=self.core.clock())
            # Readiness is judged at arrival (the user's wait starts here), not at vLLM's first ask.
            self.core.readiness.on_arrival(self.info[request.request_id], request)
        self.waiting[request.request_id] = -(-int(request.num_tokens) // self.core.block_size)
        self.arrival[request.request_id] = self.core.clock()

    def finished(self, request: RequestView) -> dict[str, Any] | None:
        """The request finished (its blocks are still held): early save, stall bookkeeping.

        Returns where its prompt KV came from (``record_provenance``), None if never admitted.
        """
        req_id = request.request_id
        provenance = self.core.demand.provenance.pop(req_id, None)
        self._finish(request)
        return provenance

    def _finish(self, request: RequestView) -> None:
        req_id = request.request_id
        info, never_admitted = self.forget(req_id)
        self.core.demand.pending_load.pop(req_id, None)
        self.core.demand.local_hit.pop(req_id, None)
        if info is not None and never_admitted:  # aborted while queued: its host copies wait no more
            self.core.planner.on_waiting_cancelled(info.session_id, now=self.core.clock())
        if info is None and self.core.policy.uses_events:
            return
        # Full blocks only: the partial tail block is never cached.
        num_full = request.num_computed_tokens // self.core.block_size
        hashes = [bytes(h) for h in list(request.block_hashes)[:num_full]]
        if info is not None:
            self.core.sessions.record_request(info.session_id, hashes, request.num_computed_tokens, req_id)
            if info.critical:
                self.core.critical.sessions.put(info.session_id, True, 1)
            else:
                self.core.critical.sessions.pop(info.session_id)
            if info.critical and hashes and info.next_stall is not None:
                # Only a session that announced a tool call is known to come back for its KV.
                until = self.core.clock() + self.core.stalls.expiry(info.next_stall.predicted_s or 0.0)
                self.core.critical.watch(info.session_id, tuple(hashes), until)
            if info.derive_stalls and info.next_stall is not None:
                self.core.stalls.begin_derived_stall(info, req_id)
        if (info is not None and info.next_stall is not None) or not self.core.policy.uses_events:
            try:
                self.core.offload.on_finished(info, hashes, self.core.clock())
            except Exception:
                self.core.stats.inc("errors.early_save")
                log.exception("TokenCake: early save for %s failed", req_id)

    def matched_tokens(self, request: RequestView, num_computed_tokens: int) -> int | None:
        """Host-pool hits past the device prefix (tokens); None = "not yet", ask again next step:
        only while a prefetch of the request's own session is being copied (the blocks are about
        to appear in the device prefix cache, loading them a second time would waste the copy),
        or while its device prefix hit includes blocks of a demand load not confirmed yet
        (:meth:`DemandLoad.waits_for_load`: no request is served KV a failed load left), each at
        most ``prefetch_wait_s``.

        Admission rules are :meth:`admit`'s, applied by TokenCake's scheduler. Without it
        (vLLM's own ``--scheduler-cls``) this only releases the holds the request needs the
        blocks of: nothing is held back — a "not yet" vLLM ignores for a request that reads no
        prefix cache cannot be a veto — so room kept ahead of returns, the critical reserve and
        the wait for a running request that held chains gave their blocks to are off (logged
        once).
        """
        req_id = request.request_id
        self.look(req_id)
        info = self.info.get(req_id)
        if info is not None:
            self.core.demand.local_hit[req_id] = num_computed_tokens
            # Stall transitions may still be queued (no step since they arrived): apply them now so
            # this request is accounted against its stall. Only bookkeeping and pins happen here.
            self.core.lifecycle.drain(self.core.clock())
            if self.core.demand.waits_for_prefetch(info, count=True):
                self.core.stats.inc("admission.held_back.prefetch")
                if self.core.decisions is not None:
                    self.core.note("wait", req=req_id, why="prefetch")
                return None
        if self.core.demand.waits_for_load(request, num_computed_tokens):
            return None
        if (
            (info is None or not info.critical)
            and len(self.core.critical.idle)
            and self.core.critical.before is None
        ):
            # Once per scheduling pass (kept current by each admission).
            self.core.critical.before = self.core.critical.cached()
        if not self.core.admission_control:
            self.core.admission.say_admission_off()
            try:  # room for it now (not before a wait for its own prefetch: that would give holds away)
                computed = list(request.block_hashes)[: num_computed_tokens // self.core.block_size]
                self.core.admission.make_room(request, [bytes(h) for h in computed], enforce=False)
            except Exception:  # room is an optimisation: never fail the admission over it
                self.core.stats.inc("errors.make_room")
                log.exception("TokenCake: releasing holds for %s failed", req_id)
        if not self.core.opts.demand_load or self.core.pool is None or self.core.host.num_blocks == 0:
            return 0
        first = num_computed_tokens // self.core.block_size
        used, found = self.core.demand.host_hits(request, first)
        if not found:
            self.core.demand.pending_load.pop(req_id, None)
            return 0
        self.core.demand.pending_load[req_id] = (first, used, found)
        return len(found) * self.core.block_size

    def allocated(self, request: RequestView, block_ids: list[int], num_external_tokens: int) -> None:
        req_id = request.request_id
        # Where the external tokens start, set first: if anything below raises, ``fail_load``
        # must report this admission's blocks (not a previous admission's of the same request).
        planned = self.core.demand.pending_load.get(req_id)
        self.core.demand.usa_req = req_id
        self.core.demand.usa_first = (
            planned[0] if planned else self.core.demand.local_hit.get(req_id, 0) // self.core.block_size
        )
        self.waiting.pop(req_id, None)
        self.admitted[req_id] = request  # to find it again if vLLM preempts it (observe_step)
        reserve_waited = self.reserve_waited(req_id)  # by the reserve's clock (inf: re-admission)
        arrived = self.arrival.pop(req_id, None)
        self.first_look.pop(req_id, None)
        info = self.info.get(req_id)
        waited: float | None = None
        if arrived is not None:  # first admission (a preempted request's re-admission is not counted)
            waited = max(self.core.clock() - arrived, 0.0)
            self.core.policy.observe_queue_delay(waited)
            who = "plain" if info is None else "critical" if info.critical else "noncritical"
            self.core.stats.observe(f"queue_wait_s.{who}", waited)
        if info is not None:
            for stall in (
                self.core.stalls.active_of(info.session_id),
                self.core.stalls.last.get(info.session_id),
            ):
                if stall is not None:
                    stall.resumed = True
        if info is not None:
            self.core.critical.unwatch(info.session_id)  # its blocks are in use again
        before, self.core.critical.before = self.core.critical.before, None
        if before is not None and (info is None or not info.critical):
            late = not self.core.admission.within_slack(info, reserve_waited)
            # The next admission's baseline.
            self.core.critical.before = self.core.critical.count_inversions(before, late)
        if info is not None and info.session_id in self.core.holds.kept:
            # Admitted: the request now holds the prefix blocks it hit; the keep has done its job.
            self.core.holds.unkeep(info.session_id, "admitted")
        pending = self.core.demand.pending_load.pop(req_id, None)
        local = self.core.demand.local_hit.pop(req_id, 0)
        try:
            self.core.demand.record_provenance(request, info, local, num_external_tokens)
        except Exception:
            self.core.stats.inc("errors.provenance")
        try:
            if (
                self.core.readiness.account_next_turn(request, local, num_external_tokens)
                and arrived is not None
            ):
                self.first_token[req_id] = (request, arrived)
        except Exception:
            self.core.stats.inc("errors.accounting")
            log.exception("TokenCake: next-turn accounting failed")
        if num_external_tokens > 0 and pending is not None:
            self.core.demand.plan_load(request, block_ids, num_external_tokens, pending)


__all__ = ["RequestBook"]
