"""Device holds: chains a policy keeps, or a prefetch brought back, pinned on device for an idle session —
and the rules by which they yield (TTL, room for running requests, a stuck engine, an admission that
needs the room).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from itertools import chain, compress
from operator import attrgetter, eq
from typing import TYPE_CHECKING

from tokencake.serving.kvcore.records import Keep
from tokencake.serving.spatial import demote_rank, reserved_sessions

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

log = logging.getLogger("vllm.tokencake")

_REF_CNT = attrgetter("ref_cnt")


class Holds:
    """Device holds (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core
        #: Blocks vLLM's running requests still need this step (TokenCake's scheduler counts them).
        self.running_need: Callable[[], int] | None = None
        #: Holds yielded to a running request this scheduling pass (``free_for_running``): with
        #: TokenCake's scheduler the pass admits no waiting request (bounded: ``admit``), so the
        #: freed blocks are the running request's.
        self.running_short = False
        #: The last pass ended that way: its step spares no block for a prefetch (``keep_free``),
        #: or the blocks just given back would be taken again before the running request's turn.
        self.short_pass = False
        #: Session id -> device blocks a policy keeps for it (``keep``).
        self.kept: dict[str, Keep] = {}
        #: What releasing holds frees, counted once while nothing changes (``HoldCounts``).
        self.counts = HoldCounts(self)

    def keep(
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
        assert self.core.pool is not None
        held = self.kept.get(session_id)
        have = {b.block_id for b in held.blocks} if held is not None else set()
        blocks = [dev for _i, _h, dev, _s in chain if dev is not None and dev.block_id not in have]
        if held is None and not blocks:
            return
        if blocks:
            self.core.pool.pin(blocks)
            self.counts.forget()
        if self.core.decisions is not None:
            ids = [b.block_id for b in blocks]
            self.core.note("hold", kind=kind, session=session_id, blocks=ids, until=until)
        if held is not None:
            held.blocks.extend(blocks)
            held.until = max(held.until, until)
            return
        self.kept[session_id] = Keep(
            session_id,
            blocks,
            until,
            now,
            rank=until if rank is None else rank,
            kind=kind,
            critical=bool(self.core.critical.sessions.get(session_id)),
        )
        self.core.stats.inc(f"{kind}.sessions")
        self.core.stats.inc(f"{kind}.blocks", len(blocks))

    def unkeep(self, session_id: str, why: str) -> None:
        held = self.kept.pop(session_id, None)
        if held is None:
            return
        self.counts.forget()
        if self.core.decisions is not None:
            self.core.note("release", kind=held.kind, session=session_id, why=why)
        if self.core.pool is not None:
            self.core.pool.release(held.blocks)
        self.core.stats.inc(f"{held.kind}.released.{why}")
        self.core.stats.observe(f"{held.kind}.held_s", max(self.core.clock() - held.since, 0.0))

    def release_until(
        self, enough: Callable[[], bool], why: str, *, spare: str = "", protect: frozenset[str] = frozenset()
    ) -> int:
        """Release holds until ``enough()``, in eviction order (``_hold_rank``); returns how many.

        ``spare``: a session whose hold stays (the request asking for room is its own);
        ``protect``: sessions whose holds stay (the critical reserve, ``AdmissionControl._protected``).
        """
        released = 0
        for held in sorted(self.kept.values(), key=self._hold_rank, reverse=True):
            if enough():
                break
            if held.session_id == spare or held.session_id in protect:
                continue
            self.unkeep(held.session_id, why)
            released += 1
        return released

    def _hold_rank(self, held: Keep) -> tuple[int, float]:
        """Which hold yields first when room is needed: the highest rank (as a demoted chain's
        ``EvictionOrder._evict_rank``)."""
        return demote_rank(critical=held.critical and self.core.critical_last, returns_at=held.rank)

    def reserved_blocks(self) -> int:
        """Device blocks held for critical-path sessions now (the reserve in use)."""
        if not self.core.critical_last:
            return 0
        return sum(len(k.blocks) for k in self.kept.values() if k.critical)

    def tick_keeps(self, now: float) -> None:
        """Expired TTLs; room for the running requests' next blocks; and when requests wait while
        the engine computed nothing this step, the latest return goes (a hold must never stop
        every request from running)."""
        for sid, held in list(self.kept.items()):
            if held.until <= now:
                self.unkeep(sid, "ttl")
        if self.kept and self.core.pool is not None:
            # A running request that finds no free block for its next token is preempted: keep
            # one free block per running request (and the reserve) whatever is held.
            floor = max(self.core.admission.reserve_blocks(), self.core.steps.running)
            pool = self.core.pool
            self.release_until(lambda: pool.num_free() >= floor, "reserve")
        stuck = (
            self.core.steps.last_step is not None
            and self.core.steps.last_step[1] == 0
            and bool(self.core.requests.waiting)
        )
        if stuck and self.kept:  # the critical reserve included: the engine must never idle
            latest = max(self.kept.values(), key=self._hold_rank)
            self.unkeep(latest.session_id, "pressure")

    def free_for_running(self) -> bool:
        """vLLM found no free block for a running request and is about to preempt one (it asks
        ``has_pending_block_frees`` first). A held chain is a device copy of KV we chose to keep,
        so it yields before any running request loses its own: release holds (latest return
        first, critical ones last, the reserve included) until the running requests have the
        blocks they still need this step (TokenCake's scheduler counts them, ``running_need``;
        without it, until one block frees) — all at once, so a chunk that needs more blocks
        than one hold frees is not stalled a step per hold.

        True: vLLM schedules no further running request this pass, and with TokenCake's
        scheduler this pass admits no waiting one (:meth:`admit`), so the request allocates next
        step instead of being preempted (without that scheduler an admission may take the freed
        blocks first). False (nothing held, or releasing frees nothing: the blocks are shared
        with running requests): vLLM preempts, as stock vLLM does.
        """
        pool = self.core.pool
        if pool is None or not self.kept:
            return False
        before = pool.num_free()
        target = before + 1
        if self.running_need is not None:
            try:
                target = max(target, int(self.running_need()))
            except Exception:  # the count is an optimisation: yield one block's worth without it
                self.core.stats.inc("errors.running_need")
                log.exception("TokenCake: counting the running requests' blocks failed")
        self.release_until(lambda: pool.num_free() >= target, "running")
        if pool.num_free() <= before:
            return False
        self.running_short = True
        self.core.stats.inc("hold.yielded_to_running")
        return True

    def release_device_holds(self) -> int:
        """vLLM is about to reset its prefix cache, which fails while any device block is in use:
        give back the chains held on device (keeps, prefetched holds); returns how many. Copies in
        flight keep their pins until the workers report them (a reset during one still fails,
        as it does for vLLM's own connectors with transfers in flight)."""
        n = len(self.kept)
        for sid in list(self.kept):
            self.unkeep(sid, "reset")
        return n


class _Snapshot:
    """The counts of one stretch in which nothing changed them (see :class:`HoldCounts`); each
    part is counted when first asked for."""

    __slots__ = ("free", "only", "reserve", "total", "union")

    def __init__(self, free: int) -> None:
        #: The pool's free blocks when it was taken (another count: it is stale).
        self.free = free
        #: Per held session: its blocks that no one but holds references (by ``id``).
        self.only: dict[str, frozenset[int]] | None = None
        #: Blocks that releasing every hold frees.
        self.total = 0
        #: Excluded sessions -> the union of their ``only`` blocks.
        self.union: dict[frozenset[str], frozenset[int]] = {}
        #: Reserve cap -> the critical reserve's sessions.
        self.reserve: dict[int, frozenset[str]] = {}


class HoldCounts:
    """What releasing holds would free, counted once while nothing that changes it happens, not
    once per waiting request: vLLM's admission loop asks about every waiting request in every
    scheduling pass, and each asks for the blocks of up to three sets of holds
    (``AdmissionControl._room_verdict``) and for the critical reserve (``_protected``).

    A hold pins each of its blocks once (:meth:`Holds.keep`), so a block's ``ref_cnt`` is at
    least the number of holds that hold it, and releasing a set of holds frees exactly the
    blocks that only holds reference (``ref_cnt`` equals their holders) and whose holders are
    all in the set. So releasing every hold but those of some sessions frees all the
    holds-only blocks less the union of those sessions' own: one walk of the held blocks, then
    per question a set lookup and the asking request's own hold.

    The counts go stale when a hold is added, extended or released, or a held block's
    ``ref_cnt`` changes. :meth:`forget` drops them, and is called:

    * by :meth:`Holds.keep` and :meth:`Holds.unkeep`;
    * where the core takes or drops references on device blocks that may be held: an
      offload's pins (``OffloadPlanning``) and a copy's release (``CopyJobs.release``);
      allocations take unreferenced blocks only, never a held one;
    * after every admission that is not told to wait (``AdmissionControl.admit``), and when
      vLLM has allocated a request's blocks (``KVCore.update_state_after_alloc``): the
      allocation references the request's prefix hits, which may be held blocks (a shared
      system prompt). Inside its admission loop vLLM changes no other reference: it allocates
      nothing for a request it skips, and frees only a request that waited for an
      asynchronous load, which TokenCake's loads never are;
    * at the end of every scheduling pass (``KVCore.observe_step``, ``KVCore.build_jobs``):
      between passes vLLM frees finished requests' blocks and preempts running ones. Only the
      admission path reads the counts, inside the next pass's admission loop, after all that.

    A snapshot is also dropped when the pool's free count is not what it was when it was taken
    (a guard: any allocation, or a free of a block no one else referenced, moves it). Within a
    pass the requests told to wait share one count.
    """

    def __init__(self, holds: Holds) -> None:
        self.holds = holds
        self._snap: _Snapshot | None = None

    def forget(self) -> None:
        """Something that may change the counts happened (see the class docstring)."""
        self._snap = None

    def _current(self) -> _Snapshot:
        pool = self.holds.core.pool
        assert pool is not None
        free = pool.num_free()
        if self._snap is None or self._snap.free != free:
            self._snap = _Snapshot(free)
        return self._snap

    def _only(self, snap: _Snapshot) -> dict[str, frozenset[int]]:
        if snap.only is None:
            kept = self.holds.kept
            holders = Counter(map(id, chain.from_iterable(k.blocks for k in kept.values())))
            snap.only = {}
            for sid, k in kept.items():  # (the walk runs in C: a GPU holds 100k blocks)
                ids = list(map(id, k.blocks))
                refs = map(eq, map(_REF_CNT, k.blocks), map(holders.__getitem__, ids))
                snap.only[sid] = frozenset(compress(ids, refs))
            snap.total = len(frozenset().union(*snap.only.values()))
        return snap.only

    def without(self, excluded: frozenset[str], own: str) -> int:
        """Blocks that releasing every hold but those of ``excluded`` and ``own`` frees (released
        together: a block two of them share counts once they both go). ``excluded`` is usually
        the same for every request of a pass; ``own`` is the asking request's session."""
        snap = self._current()
        only = self._only(snap)
        gone = snap.union.get(excluded)
        if gone is None:
            gone = snap.union[excluded] = frozenset().union(*(only[sid] for sid in excluded if sid in only))
        mine = only.get(own)
        return snap.total - len(gone) - (len(mine - gone) if mine else 0)

    def reserved(self, cap_blocks: int) -> frozenset[str]:
        """The critical reserve (:func:`~tokencake.serving.spatial.reserved_sessions`) of the
        critical-path holds, each with the blocks only it references."""
        snap = self._current()
        out = snap.reserve.get(cap_blocks)
        if out is None:
            holds = ((sid, k.rank, k.releasable) for sid, k in self.holds.kept.items() if k.critical)
            out = snap.reserve[cap_blocks] = reserved_sessions(holds, cap_blocks)
        return out


__all__ = ["HoldCounts", "Holds"]
