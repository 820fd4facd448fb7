"""Admission control in vLLM's admission loop (TokenCake's scheduler class): what a waiting request may
take beside room kept ahead of returns, the critical reserve and held chains; every wait bounded and
counted.
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import TYPE_CHECKING

from tokencake.serving.admission import ADMIT, CRITICAL_RESERVE, KEPT_ROOM, Room, room_for, within_wait_bound
from tokencake.serving.kvcore.ports import RequestView
from tokencake.serving.kvcore.records import Keep, ReqInfo, Stall
from tokencake.serving.prefetch import kept_room

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

log = logging.getLogger("vllm.tokencake")


class AdmissionControl:
    """Admission control in vLLM's admission loop (TokenCake's scheduler class) (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core
        self.said_admission_off = False
        self.returning: dict[str, int] = {}

    def _protected(self, info: ReqInfo | None, waited_s: float) -> frozenset[str]:
        """Critical-path sessions whose held blocks this admission may not take (the reserve).

        Only with the spatial scheduler on, only against a non-critical agent request that has
        waited less than ``critical_reserve_wait_s`` (past it the reserve is lent: nothing starves),
        and at most ``critical_reserve_frac`` of the device: the holds of the critical sessions
        that return soonest, while their blocks fit in that share. Nothing is set aside when no
        critical chain is held (work-conserving), and running requests are never denied blocks
        (``tick_keeps`` and ``free_for_running`` release holds for them whatever is protected).
        Plain requests (no TokenCake metadata) are never held back: a denied one would let the
        plain requests behind it go first, and they are served first come, first served.
        """
        if not self.core.critical_last or self.core.pool is None or info is None or info.critical:
            return frozenset()
        if waited_s >= self.core.opts.critical_reserve_wait_s:
            return frozenset()
        return self.core.holds.counts.reserved(
            int(self.core.opts.critical_reserve_frac * self.core.pool.num_blocks)
        )

    def reserve_blocks(self) -> int:
        assert self.core.pool is not None
        return max(
            self.core.opts.prefetch_reserve_blocks,
            int(self.core.opts.prefetch_reserve_frac * self.core.pool.num_blocks),
        )

    def keep_free(self, exclude: str | None = None, *, ahead_of_queue: bool = False) -> int:
        """Device blocks a prefetch must leave free: the larger of the reserve, one block per
        running request (a decode that finds none preempts someone) and what the queued requests
        (but ``exclude``) need — not the queue's for a return kept ahead of it (``ahead_of_queue``,
        ``reserve_returns``: the admissions that would take its room wait for it) — and every
        free block in the step after a running request found none (``free_for_running``). The
        prefetch budget and the readiness ``no_room`` test share it, so "no room" means exactly
        "the budget rule would not have uploaded it"."""
        if self.core.holds.short_pass and self.core.pool is not None:
            return self.core.pool.num_free()  # a running request found no block: none to spare
        queued = (
            0 if ahead_of_queue else sum(n for r, n in self.core.requests.waiting.items() if r != exclude)
        )
        return max(self.reserve_blocks(), self.core.steps.running, queued)

    def reserve_returns(self, now: float) -> dict[str, int]:
        """Returns whose room is kept this step (``return_reserve``): the stalls whose tool still
        runs and whose upload is due, until the late end of their likely return
        (``PlannedStall.late_at``), soonest due first while they fit in ``return_reserve_frac``
        of the device. Each keeps the blocks of its chain that could come back (the run with a
        device or host copy from block 0) that no one but its own hold references: missing
        ones and idle cached ones, which an admission's allocation would take. The chain is
        walked once, when the window opens (cheap per step at any scale); its hold, as it grows
        with the upload, is subtracted. Only with TokenCake's scheduler (``admission_control``)."""
        pool = self.core.pool
        if (
            not (self.core.reserves_returns and self.core.admission_control)
            or pool is None
            or not self.core.stalls.active
        ):
            return {}  # (without TokenCake's scheduler no admission could be held back for it)
        due: list[Stall] = []
        for stall in self.core.stalls.active.values():
            if (
                stall.ended_at is None
                and not (stall.accounted or stall.resumed)
                and stall.offloaded
                and stall.reserve_from <= now <= stall.reserve_until
            ):
                due.append(stall)
            else:
                stall.reserve_blocks = None
        cap = int(self.core.opts.return_reserve_frac * pool.num_blocks)
        out = kept_room(((st.reserve_from, st.session_id, partial(self._kept_for, st)) for st in due), cap)
        self.core.stats.set("return_reserve.blocks", sum(out.values()))
        return out

    def _kept_for(self, stall: Stall) -> int | None:
        """Blocks the stall's return keeps now: its chain's count (taken once the offload is
        confirmed) less its hold and the blocks an upload of it is copying into; None while the
        chain is not on host yet (no upload starts before it is)."""
        held = self.core.holds.kept.get(stall.session_id)
        if stall.reserve_blocks is None:
            if self.core.copies.offload_pending(stall):
                return None
            stall.reserve_blocks = self._room_to_return(stall, held)
        job = self.core.copies.jobs.get(stall.prefetch_job) if stall.prefetch_job is not None else None
        copying = len(job.device_blocks) if job is not None and job.kind == "prefetch" else 0
        return stall.reserve_blocks - (len(held.blocks) if held is not None else 0) - copying

    def _room_to_return(self, stall: Stall, held: Keep | None) -> int:
        """Blocks of the chain's returnable run (device or host copy, unbroken from block 0)
        that no one but the session's own hold references."""
        assert self.core.pool is not None
        own = {b.block_id for b in held.blocks} if held is not None else set()
        n = 0
        for h in stall.hashes:
            block = self.core.pool.cached(h)
            if block is None:
                if self.core.host.lookup(h) is None:
                    break  # a hit needs an unbroken chain from block 0
                n += 1
            elif block.ref_cnt - (block.block_id in own) == 0:
                n += 1
        return n

    def _returning_against(self, info: ReqInfo | None, own: str, waited: float) -> frozenset[str]:
        """Sessions whose kept room (``reserve_returns``) this admission must leave free: an
        agent request's first admission (``waited`` finite), while requests run (their finishing
        frees blocks; an engine that would idle never waits), never its own session's. Plain
        requests (first come, first served) and re-admissions of preempted ones are never held
        back; nor is a request past ``admission_wait_s`` (:meth:`make_room` lends it the room)."""
        if not self.returning or info is None or not math.isfinite(waited) or self.core.steps.running == 0:
            return frozenset()
        return frozenset(sid for sid in self.returning if sid != own)

    def make_room(self, request: RequestView, hits: list[bytes], *, enforce: bool) -> bool:
        """A waiting request is about to be allocated (its device prefix hits: ``hits``): release
        the holds it needs the blocks of; with ``enforce`` (TokenCake's scheduler, :meth:`admit`)
        also leave the room kept for other sessions' due returns and the critical reserve, and
        keep idle critical chains out of its eviction window.

        Runs inside vLLM's admission (before ``allocate_slots``) with vLLM's own test
        (:meth:`_admission_need`), so a held chain never delays a request that could otherwise
        run; when even releasing every hold would not make it fit, nothing is released (vLLM's
        test turns it away as stock vLLM's would). While room is kept against it, it releases no
        hold (held chains are of sessions about to return too). True (``enforce`` only): it
        waits this pass — it does not fit beside room kept for returns (at most
        ``admission_wait_s``; past it the room is lent), or would fit only with the critical
        reserve lent (``_protected``), or would evict an idle critical chain
        (``spare_chains``) — and vLLM looks at the next request. The rule is
        :func:`tokencake.serving.admission.room_for`.
        """
        pool = self.core.pool
        if pool is None or not (
            self.core.holds.kept
            or (enforce and (self.returning or (self.core.critical_last and len(self.core.critical.idle))))
        ):
            return False
        req_id = request.request_id
        info = self.core.requests.info.get(req_id)
        own = info.session_id if info is not None else ""
        need, evictable = self._admission_need(request, hits)
        waited = self.core.requests.reserve_waited(req_id)
        returning = self._returning_against(info, own, waited) if enforce else frozenset()
        protect = self._protected(info, waited) if enforce else frozenset()
        verdict, target = self._room_verdict(need, own, protect, returning)
        if verdict == KEPT_ROOM:
            if self._hold_back(req_id, "return_reserve"):
                self.core.stats.inc("return_reserve.denials")
                return True
            returning = frozenset()  # waited its bound: the kept room is lent to it
            verdict, target = self._room_verdict(need, own, protect, returning)
        if verdict == CRITICAL_RESERVE:
            # It would fit if the reserve were lent: it waits (bounded by its slack and
            # critical_reserve_wait_s, ``_protected``) and vLLM looks at the next request.
            self.core.stats.inc("spatial.reserve_denials")
            self.core.stats.inc("admission.held_back.critical_reserve")
            return True
        if target > pool.num_free():  # (never while room is kept against it)
            keep = protect | returning
            self.core.holds.release_until(lambda: pool.num_free() >= target, "room", spare=own, protect=keep)
        # After any release: released blocks join the back of the free queue, and the critical
        # chains this spares must stay behind them. (It can only ask the request to wait when
        # the request fits without releasing anything, so nothing is released for a waiter.)
        if not enforce:
            return False
        return self.core.critical.spare_chains(info, need, waited, frozenset(hits), evictable)

    def _room_verdict(
        self, need: int, own: str, protect: frozenset[str], returning: frozenset[str]
    ) -> tuple[str, int]:
        """:func:`room_for` on the device now: the holds this admission may take (not its own
        session's, the reserve's or returning sessions'), then those of returning sessions,
        then the reserve's (each counted with those before it: shared blocks free only together;
        :class:`~tokencake.serving.kvcore.holds.HoldCounts`)."""
        assert self.core.pool is not None
        free = self.core.pool.num_free()
        kept = sum(self.returning[sid] for sid in returning)
        if free >= need + kept:
            return ADMIT, 0
        counts = self.core.holds.counts
        holds = counts.without(protect | returning, own)
        with_back = counts.without(protect, own)
        with_lent = counts.without(frozenset(), own)
        room = Room(free, need, kept, holds, with_back - holds, with_lent - with_back)
        return room_for(room)

    def may_wait_for_reserve(self, info: ReqInfo, waited_s: float) -> bool:
        """Whether this non-critical agent request may wait for the critical reserve: it has
        waited less than its slack (the app's end is not delayed) and ``critical_reserve_wait_s``,
        and requests run (their finishing frees blocks; an engine that would idle never waits).
        Plain requests never wait (first come, first served)."""
        return self.core.opts.critical_reserve_frac > 0 and self.within_slack(info, waited_s)

    def within_slack(self, info: ReqInfo | None, waited_s: float | None) -> bool:
        """Whether an admission could still have waited without delaying its own app: an agent
        request on its first admission that has waited (``waited_s``, by the reserve's clock:
        :meth:`reserve_waited`) less than its node's slack and ``critical_reserve_wait_s``,
        while requests run. Plain requests, re-admissions (None or inf) and requests past that
        point could not: an inversion they cause is "late"."""
        if info is None or waited_s is None or self.core.steps.running == 0:
            return False
        return waited_s < min(info.slack_s, self.core.opts.critical_reserve_wait_s)

    def admit(self, request: RequestView, num_running: int) -> bool:
        """TokenCake's scheduler asks this about every waiting request vLLM's admission loop looks
        at, before vLLM's own test (``num_running``: vLLM's running requests). True: vLLM goes on
        with it — having made room: the held chains it needs the blocks of are released
        (:meth:`make_room`). False: it waits this pass; vLLM skips it and looks at the next one.

        A request waits while held chains just gave their blocks to a running request this pass
        (``free_for_running``) or while it would take room kept for other sessions' due returns —
        each at most ``admission_wait_s`` after vLLM first looked at it — or for the critical
        reserve (within its node's slack and ``critical_reserve_wait_s``). Each pass it waits is
        counted (``admission.held_back.<reason>``), and each time its bound let it go on
        (``admission.past_bound.<reason>``). A request waiting for its own session's prefetch
        goes on here and waits in :meth:`get_num_new_matched_tokens` (vLLM's "not yet"), with no
        room made for it. A request that holds KV already (a finished asynchronous load) is left
        to vLLM.
        """
        waits = False
        try:
            waits = not self._admits(request, num_running)
        finally:
            if not waits:  # vLLM may allocate for it next (``HoldCounts``)
                self.core.holds.counts.forget()
        return not waits

    def _admits(self, request: RequestView, num_running: int) -> bool:
        """:meth:`admit`'s answer."""
        req_id = request.request_id
        self.core.requests.look(req_id)
        self.core.steps.running = max(0, int(num_running))  # vLLM's watermark and "while requests run"
        if int(getattr(request, "num_computed_tokens", 0) or 0) > 0:
            return True
        if self.core.holds.running_short and self._hold_back(req_id, "running"):
            self.core.stats.inc("hold.admission_waits_for_running")
            if self.core.decisions is not None:
                self.core.note("wait", req=req_id, why="running")
            return False
        info = self.core.requests.info.get(req_id)
        if info is not None:
            self.core.lifecycle.drain(self.core.clock())  # queued stall transitions may change what is held
            if self.core.demand.waits_for_prefetch(info, count=False):
                return True
        if self.make_room(request, self.core.demand.local_hits(request), enforce=True):
            if self.core.decisions is not None:
                self.core.note("wait", req=req_id, why="room")
            return False
        return True

    def _hold_back(self, req_id: str, reason: str) -> bool:
        """Whether the request may wait this pass for ``reason``: until ``admission_wait_s``
        after vLLM first looked at it. Counts the pass it waits, or that it went on past its
        bound."""
        if within_wait_bound(
            self.core.requests.first_look.get(req_id), self.core.clock(), self.core.opts.admission_wait_s
        ):
            self.core.stats.inc(f"admission.held_back.{reason}")
            return True
        self.core.stats.inc(f"admission.past_bound.{reason}")
        return False

    def _admission_need(self, request: RequestView, hits: list[bytes]) -> tuple[int, int]:
        """``(need, evictable)`` by vLLM's test in ``allocate_slots``: the blocks the prompt and
        its lookahead slots take beyond its prefix ``hits`` — the whole prompt when vLLM admits
        only what fits whole (``full_sequence_must_fit``, its default), else this step's chunk
        (``max_num_batched_tokens`` past the hits and the host-pool hits loaded into new
        blocks) — plus the hits that sit in the free queue (vLLM counts them against the free
        blocks too: ``evictable``), plus the watermark while requests run. An upper bound by
        the lookahead slots of a chunk that ends before the prompt does."""
        assert self.core.pool is not None
        evictable = 0
        for h in hits:
            block = self.core.pool.cached(h)
            evictable += block is not None and block.ref_cnt == 0
        tokens = int(request.num_tokens)
        if not self.core.full_sequence_must_fit:
            first = len(hits)
            computed = (first + len(self.core.demand.host_hits(request, first)[0])) * self.core.block_size
            tokens = min(tokens, computed + self.core.max_step_tokens)
        need = -(-(tokens + self.core.lookahead_tokens) // self.core.block_size) - len(hits) + evictable
        if self.core.steps.running:
            need += int(self.core.watermark * self.core.pool.num_blocks)
        return need, evictable

    def say_admission_off(self) -> None:
        if not self.said_admission_off:
            self.said_admission_off = True
            log.warning(
                "TokenCake: admission control off (vLLM's own scheduler, not --scheduler-cls %s): "
                "no room kept ahead of returns, no critical reserve, and admissions may take the "
                "blocks held chains give back for a running request",
                "tokencake.serving.vllm.scheduler.SpatialScheduler",
            )


__all__ = ["AdmissionControl"]
