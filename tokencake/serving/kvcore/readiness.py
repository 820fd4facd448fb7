"""A session's next turn, accounted: how much of its repeated prefix came from device, host or was
recomputed (and why), whether its chain was ready at arrival, and the prefetch outcome.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokencake.serving.kvcore.ports import RequestView
from tokencake.serving.kvcore.records import ReqInfo, Stall
from tokencake.serving.prefetch import miss_reason

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

log = logging.getLogger("vllm.tokencake")


class Readiness:
    """A session's next turn, accounted (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core

    def room_for_chain(self, session_id: str, req_id: str) -> bool:
        """Whether the device could take the session's missing chain blocks right now under the
        prefetch budget rule (free − own idle − ``keep_free`` without this request's own need,
        plus what other sessions' holds would yield). False means even a prefetch issued
        at this moment would have waited: the request queues for room whatever was prefetched."""
        pool = self.core.pool
        stall = self.core.stalls.last.get(session_id) or self.core.stalls.active_of(session_id)
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
        yieldable = sum(k.releasable for k in self.core.holds.kept.values() if k.session_id != session_id)
        room = pool.num_free() - own_idle - self.core.admission.keep_free(exclude=req_id) + yieldable
        return room >= missing

    def repeated_chain_on_device(self, session_id: str, request: RequestView) -> int | None:
        """Leading blocks of the session's last chain that ``request`` repeats and that are cached
        on device now (None: no chain, or no pool yet)."""
        pool = self.core.pool
        stall = self.core.stalls.last.get(session_id) or self.core.stalls.active_of(session_id)
        if pool is None or stall is None:
            return None
        limit = (request.num_tokens - 1) // self.core.block_size
        n = 0
        for old, new in zip(stall.hashes, list(request.block_hashes)[:limit], strict=False):
            if old != bytes(new) or pool.cached(old) is None:
                break
            n += 1
        return n

    def _count_recomputed(self, stall: Stall, request: RequestView, first: int, end: int) -> None:
        """Why the blocks ``first..end`` of a resumed session's repeated prefix were recomputed
        (``next_turn.recomputed_why.<cause>``, in blocks): ``lost_before_decision`` (evicted from
        device before the stall was first decided, never on host), ``not_saved.<reason>`` (the stall
        was not offloaded for that reason), ``host_dropped`` (offloaded, the host copy gone since:
        reclaimed or preempted), ``on_host`` (a host copy exists but was not served: the chain broke
        before it), ``not_asked`` (the stall was never decided)."""
        hashes = list(request.block_hashes)
        for i in range(first, end):
            if self.core.host.lookup(bytes(hashes[i])) is not None:
                why = "on_host"
            elif stall.chain_at_decision is None:
                why = "not_asked"
            elif i >= stall.chain_at_decision:
                why = "lost_before_decision"
                # ... after the finish decided this (the save that would have kept it did not happen).
                self.core.stats.inc(f"next_turn.lost_before_decision_after.{stall.finish_decision or 'none'}")
            elif not stall.offloaded:
                why = f"not_saved.{stall.decision}"
            else:
                why = "host_dropped"
            self.core.stats.inc(f"next_turn.recomputed_why.{why}")

    def account_next_turn(self, request: RequestView, local: int, external: int) -> bool:
        """Readiness, prefetch outcome and recomputed prefix tokens for a session's next turn.

        Returns whether the request is one (the first request of a session after a stall)."""
        info = self.core.requests.info.get(request.request_id)
        if info is None:
            return False
        session_id = info.session_id
        stall = self.core.stalls.last.get(session_id)
        if stall is None or stall.accounted:
            return False
        stall.accounted = True
        # The part of the previous turn this prompt repeats (the chat template may re-tokenize the
        # tail of the previous output differently, so compare hashes instead of assuming all).
        limit = (request.num_tokens - 1) // self.core.block_size
        common = 0
        for old, new in zip(stall.hashes, list(request.block_hashes)[:limit], strict=False):
            if old != bytes(new):
                break
            common += 1
        chain_tokens = common * self.core.block_size
        device = min(local, chain_tokens)
        served = min(local + external, chain_tokens)
        self.core.stats.inc("next_turn.requests")
        self.core.stats.inc("next_turn.prefix_tokens", chain_tokens)
        self.core.stats.inc("next_turn.prefix_tokens_device", device)
        self.core.stats.inc("next_turn.prefix_tokens_host", served - device)
        self.core.stats.inc("next_turn.prefix_tokens_recomputed", chain_tokens - served)
        if stall.critical:  # what the critical path recomputed: the cost a critical inversion has
            self.core.stats.inc("next_turn.critical.prefix_tokens", chain_tokens)
            self.core.stats.inc("next_turn.critical.prefix_tokens_recomputed", chain_tokens - served)
        self.core.stats.set("next_turn.last_recomputed", chain_tokens - served)
        if served < chain_tokens:
            self._count_recomputed(stall, request, served // self.core.block_size, common)
        self.core.stats.set("next_turn.last_device", device)
        self.core.stats.set("next_turn.last_host", served - device)
        # Readiness: were the blocks on device (or being copied there) when the request came? Only
        # stalls long enough for a copy to fit count; shorter ones nobody could have served. Judged
        # at arrival: a prefetch that lands while the request queues was not ready for it.
        on_device = device >= chain_tokens
        at_arrival = info.device_blocks_at_arrival
        ready_on_device = (
            on_device if at_arrival is None else at_arrival * self.core.block_size >= chain_tokens
        )
        ended_at = stall.ended_at if stall.ended_at is not None else self.core.clock()
        if chain_tokens > 0 and ended_at - stall.begin_at > stall.lead_s:
            if info.arrived_while_loading:
                ready = "loading"
            elif ready_on_device:
                ready = "prefetched" if stall.prefetched else "not_needed"
            else:
                ready = "missed"
                why = info.missed_why_at_arrival or miss_reason(
                    self.core.planner.get(stall.stall_id),
                    room_at_arrival=info.room_at_arrival,
                    deferred=stall.deferred,
                )
                self.core.stats.inc(f"readiness.missed_why.{why}")
            self.core.stats.inc("readiness.eligible")
            self.core.stats.inc(f"readiness.{ready}")
            if info.room_at_arrival is False:
                # The device had no room for the chain when the request came (running and queued
                # requests held it): being ready at arrival was not possible without starving them.
                self.core.stats.inc("readiness.no_room")
                self.core.stats.inc(f"readiness.no_room_{ready}")
        # Classify the session's planned stalls: on time only if the whole repeated prefix was on
        # device when the request came (a prefetch or blocks that were never evicted).
        # With prefetch off the planner still tracks the stall (pins, expiry): count apart so the
        # prefetch outcome counters only ever describe prefetches.
        outcome = "prefetch" if self.core.prefetch_enabled else "no_prefetch"
        for sid, cls in self.core.planner.on_request(
            session_id, hit_on_device=on_device, partial=stall.topup
        ):
            self.core.stats.inc(f"{outcome}.{cls}")
            done = self.core.stalls.get(sid)
            if cls == "on_time" and done is not None and done.prefetched:
                self.core.stats.inc("tokens.prefetched_hit", len(done.prefetched) * self.core.block_size)
            self.core.stalls.release(sid)
        # The next turn has what it needs (loaded, hit or recomputed): unpin the host copies. They
        # stay indexed (LRU-reclaimable) for later hits. The record (and its hashes) is done.
        self.core.stalls.release(stall.stall_id)
        self.core.stalls.last.pop(session_id)
        return True

    def on_arrival(self, info: ReqInfo, request: RequestView) -> None:
        """How the session's chain stands when its next request arrives (readiness is judged
        then, not at vLLM's first look: under a long queue that is much later)."""
        info.arrived_while_loading = (
            self.core.copies.jobs.get(self.core.copies.prefetching.get(info.session_id, 0)) is not None
        )
        info.room_at_arrival = self.room_for_chain(info.session_id, request.request_id)
        info.device_blocks_at_arrival = self.repeated_chain_on_device(info.session_id, request)
        last = self.core.stalls.last.get(info.session_id)
        if last is not None and not last.accounted:
            info.missed_why_at_arrival = miss_reason(
                self.core.planner.get(last.stall_id),
                room_at_arrival=info.room_at_arrival,
                deferred=last.deferred,
            )


__all__ = ["Readiness"]
