"""Prefetch: a stall's chain brought back host → device before its predicted return, within the budget the
queue leaves, topped up when room frees, held until its request comes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokencake.serving.kvcore.records import Job, Stall

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

log = logging.getLogger("vllm.tokencake")


class Uploads:
    """Prefetch (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core
        #: Stalls whose upload brought only the chain's head (``Stall.topup``), in upload order.
        self.topups: dict[str, None] = {}

    def chain_on_device(self, stall: Stall) -> bool:
        """Whether every block of the stall's chain that has a host copy is cached on device."""
        if self.core.pool is None:
            return False
        for h in stall.hashes:
            if self.core.pool.cached(h) is None and self.core.host.lookup(h) is not None:
                return False
        return True

    def recheck_prefetched(self, now: float) -> None:
        """Prefetched chains of tools still running that were evicted since: upload again (bounded)."""
        for plan in self.core.planner.open_stalls():
            if plan.state != "on_device" or plan.ended_at is not None:
                continue
            stall = self.core.stalls.active.get(plan.stall_id)
            # A chain uploaded in part is topped up (``try_topup``), whatever of it is missing.
            if stall is not None and not stall.topup and not self.chain_on_device(stall):
                self.core.planner.mark_evicted(plan.stall_id, now=now)

    def try_topup(self, stall_id: str, now: float) -> None:
        """Upload the rest of a chain whose last upload brought only its head, once the budget
        has room again — while the tool runs or its request has not come (then the request's own
        demand load brings the rest). One copy in flight per session."""
        stall = self.core.stalls.get(stall_id)
        plan = self.core.planner.get(stall_id)
        if (
            stall is None
            or plan is None
            or plan.state not in ("prefetching", "on_device")
            or plan.waiting_since is not None
            or stall.accounted
            or stall.resumed
        ):
            self.topups.pop(stall_id, None)  # ``stall.topup`` stays: what the request found
        elif plan.state == "on_device" and stall.session_id not in self.core.copies.prefetching:
            self.try_prefetch(stall, now, topup=True)

    def try_prefetch(self, stall: Stall, now: float, *, topup: bool = False) -> None:
        """Bring the stall's missing chain blocks back into the device prefix cache (planner: due).

        Budget: the free blocks minus what must stay free — the larger of the reserve and the
        blocks the queued requests need — so a prefetch never starves the queue, but a queue that
        has its blocks does not stop it either. A budget smaller than the need prefetches the
        chain's head (a usable prefix) and tops up the rest when room frees (``topup``: this call
        is such a top-up; the plan is already ``on_device``); demand load brings what is still
        missing when the request comes.
        """
        pool = self.core.pool
        if pool is None:
            return
        self.core.eviction.promote(stall)  # blocks still on device must survive the allocation below
        if self.core.copies.offload_pending(stall):
            return  # stays due: retried once the offload is confirmed
        need: list[tuple[int, bytes, int]] = []
        own_idle = 0
        for i, h in enumerate(stall.hashes):
            block = pool.cached(h)
            if block is not None:
                own_idle += block.ref_cnt == 0
                continue
            slot = self.core.host.lookup(h)
            if slot is None:
                break  # a hit needs an unbroken chain from block 0
            need.append((i, h, slot))
        if not need:
            if topup:  # the rest came back some other way (or is not on host): nothing to top up
                self.topups.pop(stall.stall_id, None)
                stall.topup = False
                return
            # Everything is still cached on device: nothing to copy (the end re-checks).
            self.core.planner.mark_started(stall.stall_id, now=now)
            self.core.planner.mark_done(stall.stall_id, now=now)
            self.core.stats.inc("prefetch.not_needed")
            return
        # Our own idle cached blocks are counted free by vLLM, but allocating them would break the chain.
        keep = self.core.admission.keep_free(ahead_of_queue=stall.session_id in self.core.admission.returning)
        budget = pool.num_free() - own_idle - keep
        if budget <= 0:
            if topup:
                return  # tried again next step
            if stall.deferred == 0:
                queued = sum(self.core.requests.waiting.values())
                reserve = max(self.core.admission.reserve_blocks(), self.core.steps.running)
                self.core.stats.inc(
                    "prefetch.deferred.waiting" if queued > reserve else "prefetch.deferred.headroom"
                )
            stall.deferred += 1
            return
        stall.topup = budget < len(need)
        if stall.topup:
            need = need[:budget]
            self.core.stats.inc("prefetch.topup_partial" if topup else "prefetch.partial")
            self.topups[stall.stall_id] = None
        else:
            self.topups.pop(stall.stall_id, None)
        if topup:
            self.core.stats.inc("prefetch.topups")
        blocks = pool.allocate(len(need))
        job = self.core.copies.new_job(
            "prefetch",
            [h for _i, h, _s in need],
            [i for i, _h, _s in need],
            blocks,
            [s for *_x, s in need],
            stall_id=stall.stall_id,
            session_id=stall.session_id,
        )
        job.device_owned = True
        self.core.host.pin_many(job.slots, job.owner)
        stall.prefetch_job = job.job_id
        self.core.copies.prefetching[stall.session_id] = job.job_id
        self.core.planner.mark_started(stall.stall_id, now=now)
        self.core.copies.outbox.append(job.to_wire())
        self.core.stats.inc("prefetch.jobs")

    def hold_prefetched(self, job: Job) -> None:
        """Keep a prefetched chain on device until its session's request is admitted.

        Unpinned, the uploaded blocks sit in vLLM's free queue and the allocations of the requests
        running meanwhile evict them before the tool returns (a heavy-tailed tool is back long
        after an early prefetch). The hold displaces only idle cached blocks: it yields to any
        request that needs the room to be admitted (``make_room``), to the running requests'
        next blocks and to a stuck engine (``tick_keeps``), the latest predicted return first.
        """
        if not self.core.opts.hold_prefetched or self.core.pool is None or job.session_id is None:
            return
        stall = self.core.stalls.get(job.stall_id or "")
        if stall is None or stall.accounted or stall.resumed:
            return  # the request came first (it waited for this copy, or loaded on demand)
        chain = []
        for h in stall.hashes:  # the usable prefix: from block 0, unbroken
            block = self.core.pool.cached(h)
            if block is None:
                break
            chain.append((0, h, block, None))
        if not chain:
            return
        now = self.core.clock()
        if stall.ended_at is not None:
            until = stall.ended_at + self.core.opts.keep_after_end_s
        else:
            until = stall.calls.deadline(self.core.stalls.expiry)
        self.core.holds.keep(job.session_id, chain, until, now, rank=stall.returns_at, kind="hold")


__all__ = ["Uploads"]
