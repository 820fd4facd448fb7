"""The eviction order of idle chains: an offloaded stall's blocks first in line (latest return first,
critical-path ones last), back to the safe end when its session is about to run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokencake.serving.kvcore.ports import DeviceBlock as KVCacheBlock
from tokencake.serving.kvcore.records import Stall
from tokencake.serving.spatial import demote_rank

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

log = logging.getLogger("vllm.tokencake")


class EvictionOrder:
    """The eviction order of idle chains (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core
        #: Offloaded stalls whose idle device blocks are at the front of the eviction queue, in
        #: the order they were demoted (a dict: chains that tie on their rank keep that order when
        #: the queue is rebuilt, whatever the string hash seed).
        self.demoted: dict[str, None] = {}

    def chain_blocks(
        self, stall: Stall, *, on_host_only: bool, first_in_line: bool = False
    ) -> list[KVCacheBlock]:
        """The stall's cached device blocks in eviction order (tail first, the head last).

        ``first_in_line``: they are about to go to the front of the eviction queue; a block that
        another live stall's chain shares (a common system prompt) is left out when that stall
        should keep it longer (:meth:`_kept_by_another`), so one session's demotion never costs
        the others their device hits."""
        assert self.core.pool is not None
        out: list[KVCacheBlock] = []
        for h in stall.hashes:
            block = self.core.pool.cached(h)
            if block is None:
                continue
            if on_host_only and self.core.host.lookup(h) is None:
                continue
            if first_in_line and self._kept_by_another(stall, h):
                continue
            out.append(block)
        out.reverse()
        return out

    def _kept_by_another(self, stall: Stall, h: bytes) -> bool:
        """Whether another live stall that holds block ``h`` should lose it later than ``stall``:
        one not demoted (it was not offloaded, or is not evicted first), or one demoted behind it
        (an equal or lower eviction rank). A shared block then moves with that stall, if ever."""
        others = self.core.stalls.users.others(stall.stall_id, h)
        if not others:
            return False
        rank = self._evict_rank(stall)
        return any(
            (other := self.core.stalls.active.get(sid)) is not None
            and (sid not in self.demoted or self._evict_rank(other) <= rank)
            for sid in others
        )

    def demote(self, stall: Stall) -> None:
        """Put the idle device blocks of an offloaded stall first in line for eviction.

        vLLM's free queue is LRU, and a session that just went idle is its most recently used
        entry: stock vLLM evicts the *active* sessions' prefixes first. Once a stalled session's
        chain is safe on host its device copy is the cheapest thing to lose (a host → device copy
        brings it back), so it goes to the front: non-critical sessions ahead of critical-path ones
        (a critical session's recompute delays its whole app), and within each, the session that
        returns last ahead of the others (KVFlow's steps-to-execution order, with time instead of
        steps). Only blocks with a ready host copy move.
        """
        if (
            not self.core.demote_enabled
            or self.core.pool is None
            or stall.stall_id not in self.core.stalls.active
        ):
            return
        if not stall.evict_first:
            return
        self.demoted.setdefault(stall.stall_id)
        demoted = [s for s in (self.core.stalls.active.get(sid) for sid in self.demoted) if s is not None]
        rank = self._evict_rank
        if all(rank(s) <= rank(stall) for s in demoted):
            # It is evicted first (the usual case: it began last): only its chain moves to the
            # front, in front of the others' — the order a full re-queue gives, in O(chain) instead
            # of O(demoted × chain) (a thousand stalled sessions with long chains on a GPU).
            order = [stall]
        else:
            order = sorted(demoted, key=rank)  # stable: ties in the order they were demoted
        moved = 0
        for s in order:  # each batch goes in front of the previous one: the latest return ends first
            blocks = self.chain_blocks(s, on_host_only=True, first_in_line=True)
            moved += self.core.pool.reorder(blocks, first=True)
        self.core.stats.inc("evict_order.demoted_blocks", moved)

    def _evict_rank(self, stall: Stall) -> tuple[int, float]:
        """A demoted chain's place in the eviction queue: the highest rank is evicted first."""
        return demote_rank(critical=stall.critical and self.core.critical_last, returns_at=stall.returns_at)

    def promote(self, stall: Stall) -> None:
        """The session is about to run again: its idle device blocks go back to the safe end."""
        if stall.stall_id not in self.demoted:
            return
        del self.demoted[stall.stall_id]
        if self.core.demote_enabled and self.core.pool is not None:
            moved = self.core.pool.reorder(self.chain_blocks(stall, on_host_only=False), first=False)
            self.core.stats.inc("evict_order.promoted_blocks", moved)


__all__ = ["EvictionOrder"]
