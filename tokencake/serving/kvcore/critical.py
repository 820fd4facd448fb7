"""Critical-path sessions (spatial scheduler on): their idle chains kept out of a non-critical admission's
eviction window, and the inversions counted when one is evicted anyway.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokencake.serving.kvcore.records import CRITICAL_SESSIONS, ReqInfo, Watch
from tokencake.serving.sessions import ByteLRU, hashes_nbytes
from tokencake.serving.spatial import CRITICAL_WATCH

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

log = logging.getLogger("vllm.tokencake")


class CriticalWatch:
    """Critical-path sessions (spatial scheduler on) (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core
        #: Idle chains of critical-path sessions (their request finished; the next one is not
        #: admitted yet), and their cached-block counts before a non-critical admission.
        self.idle: ByteLRU[str, Watch] = ByteLRU(
            max_items=CRITICAL_WATCH, max_bytes=16 << 20, on_evict=self._forget_hashes
        )
        #: Block hash → the watched critical sessions whose idle chain has it (the index a
        #: non-critical admission's eviction window is checked against, O(window)).
        self.owners: dict[bytes, set[str]] = {}
        self.before: dict[str, frozenset[bytes]] | None = None
        #: Sessions whose latest finished request was on the critical path (``Stall.critical``).
        self.sessions: ByteLRU[str, bool] = ByteLRU(max_items=CRITICAL_SESSIONS, max_bytes=1 << 20)

    def watch(self, session_id: str, hashes: tuple[bytes, ...], until: float) -> None:
        self.unwatch(session_id)
        # May push out the oldest watch (``on_evict`` keeps the index in step).
        self.idle.put(session_id, Watch(hashes, until), hashes_nbytes(hashes))
        for h in hashes:
            self.owners.setdefault(h, set()).add(session_id)

    def unwatch(self, session_id: str) -> None:
        watch = self.idle.pop(session_id)
        if watch is not None:
            self._forget_hashes(session_id, watch)

    def _forget_hashes(self, session_id: str, watch: Watch) -> None:
        for h in watch.hashes:
            owners = self.owners.get(h)
            if owners is not None:
                owners.discard(session_id)
                if not owners:
                    del self.owners[h]

    def spare_chains(
        self,
        info: ReqInfo | None,
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
        that may wait for the critical reserve (:meth:`may_wait_for_reserve`): it may take no
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
        pool = self.core.pool
        if not self.core.critical_last or pool is None or (info is not None and info.critical):
            return False
        owners, now = self.owners, self.core.clock()
        if not owners:
            return False
        waiting: set[str] | None = None  # built only if a watched block is in the window
        may_wait = info is not None and self.core.admission.may_wait_for_reserve(info, waited_s)
        own = info.session_id if info is not None else None

        def back(sid: str) -> bool:
            """Expected back: its stall_begin may not have come yet, the tool runs, or its next
            request waits — not a session gone silent past the announced tool's expiry."""
            nonlocal waiting
            watch = self.idle.get(sid)
            if (watch is not None and now < watch.until) or self.core.stalls.active_of(sid) is not None:
                return True
            if waiting is None:
                waiting = self.core.requests.waiting_sessions()
            return sid in waiting

        def reserved(h: bytes) -> bool:
            sids = owners.get(h)
            return bool(sids) and any(sid != own and back(sid) for sid in sids)

        spare_safe = may_wait or self.core.opts.critical_spare_late

        def spare(h: bytes) -> bool:
            return reserved(h) and (spare_safe or self.core.host.lookup(h) is None)

        window = need - own_free  # the blocks it evicts or takes fresh
        skip = own_hits.__contains__ if own_hits else None
        spared = pool.in_eviction_window(spare, window, skip)
        if spared:
            moved = pool.reorder(spared, first=False)
            self.core.stats.inc("spatial.critical_spared_blocks", moved)
        if not may_wait or not spared or pool.num_free() < need:
            return False  # (a request that does not fit waits anyway, in vLLM's queue order)
        if not pool.in_eviction_window(reserved, window, skip):
            return False
        self.core.stats.inc("spatial.critical_reserve_waits")  # steps an admission waited
        self.core.stats.inc("admission.held_back.critical_chain")
        if info is not None and not info.reserve_waited:
            info.reserve_waited = True
            self.core.stats.inc("spatial.critical_reserve_waited_requests")
        return True

    def cached(self) -> dict[str, frozenset[bytes]]:
        """Per watched critical session: the blocks of its idle chain that are cached on device."""
        pool = self.core.pool
        if pool is None:
            return {}
        return {
            sid: frozenset(h for h in watch.hashes if pool.cached(h) is not None)
            for sid, watch in self.idle.items()
        }

    def count_inversions(
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
        without delaying its own app (``late``: see :meth:`within_slack`) — the ones the critical
        reserve may not prevent. Returns the cached blocks now."""
        after = self.cached()
        for sid, cached in before.items():
            lost = cached - after.get(sid, cached)
            if not lost:
                continue
            unsaved = sum(self.core.host.lookup(h) is None for h in lost)
            self.core.stats.inc("spatial.critical_inversions")
            self.core.stats.inc("spatial.critical_blocks_evicted", len(lost))
            if late:
                self.core.stats.inc("spatial.critical_inversions_late")
            if unsaved:
                self.core.stats.inc("spatial.critical_inversions_unsaved")
                self.core.stats.inc("spatial.critical_blocks_evicted_unsaved", unsaved)
        return after


__all__ = ["CriticalWatch"]
