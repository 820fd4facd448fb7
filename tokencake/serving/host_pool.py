"""The host block pool's scheduler-side bookkeeping.

:class:`HostPool` is pure bookkeeping over ``num_blocks`` slot indices: free list, block-hash →
slot index, per-slot state (``free`` → ``filling`` → ``ready``), owners (stall or session ids)
that pin slots, and an LRU of ready slots nobody owns, reclaimed when the free list runs dry.
A hash becomes visible to :meth:`HostPool.lookup` only after :meth:`HostPool.commit`, i.e.
after the copy is confirmed, so nobody can load a half-written block.

The host memory itself is :class:`tokencake.serving.vllm._copy.BlockCopier`: one tensor per KV
layer, allocated once in the worker process (pinned on CUDA) and reused forever, plus the D2H /
H2D block copies. The slot indices handed out here are its host block indices.

Nothing here imports torch (the scheduler side runs without tensors).

Memory is fixed by ``num_blocks``: about 60 bytes per slot, plus about 220 per ready slot (its
32-byte hash, index and LRU entries); owner sets exist only for pinned slots.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Literal

__all__ = [
    "HostPool",
    "HostPoolExhausted",
    "SlotState",
    "blocks_for_gib",
    "preemption_victims",
]

SlotState = Literal["free", "filling", "ready"]


class HostPoolExhausted(RuntimeError):
    """Raised by :meth:`HostPool.allocate` when neither free nor reclaimable slots suffice."""


def blocks_for_gib(gib: float, bytes_per_block: int) -> int:
    """How many whole blocks of ``bytes_per_block`` fit in ``gib`` GiB (at least 0)."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
    if not math.isfinite(gib) or gib < 0:
        raise ValueError(f"host pool size must be a finite GiB value >= 0, got {gib}")
    return int(gib * (1 << 30)) // bytes_per_block


def preemption_victims(
    host: HostPool,
    later: list[tuple[Any, str, Sequence[bytes]]],
    *,
    limit: int | None = None,
    own: AbstractSet[bytes] = frozenset(),
    skip: AbstractSet[int] = frozenset(),
) -> list[int]:
    """Host slots a save may take from stalls returning later than its own (Belady's rule).

    ``later``: ``(rank, owner id, chain hashes)`` of those stalls; the highest rank goes first (the
    eviction-queue order: latest return first), each chain tail first (a hit needs the chain from
    block 0, so the head is the last to go). A slot is a victim only if every owner is one of these
    stalls — never a copy in flight, a stall returning sooner or any other pin — and it is neither a
    block of the saver's own chain (``own``: a shared prefix it needs too) nor in ``skip`` (slots a
    planned load will read). At most ``limit`` slots (None: all).
    """
    ids = {owner for _rank, owner, _hashes in later}
    victims: dict[int, None] = {}
    for _rank, _owner, hashes in sorted(later, key=lambda x: x[0], reverse=True):
        for h in reversed(hashes):
            if h in own:
                continue
            slot = host.lookup(h)
            if slot is None or slot in skip or slot in victims:
                continue
            owners = host.owners(slot)
            if owners and owners <= ids:
                victims[slot] = None
                if limit is not None and len(victims) >= limit:
                    return list(victims)
    return list(victims)


class HostPool:
    """Slot bookkeeping of the host block pool (thread-safe; O(1) per slot operation)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._lock = threading.RLock()
        self._free: deque[int] = deque(range(num_blocks))
        self._state: list[SlotState] = ["free"] * num_blocks
        self._filling = 0  # slots in state "filling" (counted, not scanned: stats are polled)
        self._hash: list[bytes | None] = [None] * num_blocks
        #: slot -> its owners, only for slots that have any (most slots never do at once).
        self._owners: dict[int, set[str]] = {}
        self._index: dict[bytes, int] = {}
        #: owner -> its slots in the order it pinned them (a chain is pinned head first).
        self._owned: dict[str, dict[int, None]] = {}
        # Ready slots without owners, oldest first: the reclaim order.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._counts = dict.fromkeys(
            ("allocated", "committed", "deduplicated", "invalidated", "reclaimed", "exhausted", "preempted"),
            0,
        )

    # ----------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def num_reclaimable(self) -> int:
        """Ready slots no owner pins (reclaimed LRU-first when the free list is empty)."""
        with self._lock:
            return len(self._lru)

    @property
    def available(self) -> int:
        """Slots an :meth:`allocate` call can get right now (free + reclaimable)."""
        with self._lock:
            return len(self._free) + len(self._lru)

    @property
    def num_ready(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def num_filling(self) -> int:
        with self._lock:
            return self._filling

    def state(self, slot: int) -> SlotState:
        with self._lock:
            return self._state[self._check(slot)]

    def hash_of(self, slot: int) -> bytes | None:
        """The block hash a ready slot holds (None while free or filling)."""
        with self._lock:
            return self._hash[self._check(slot)]

    def owners(self, slot: int) -> frozenset[str]:
        with self._lock:
            return frozenset(self._owners.get(self._check(slot), ()))

    def owned_by(self, owner: str) -> list[int]:
        with self._lock:
            return sorted(self._owned.get(owner, ()))

    def lookup(self, block_hash: bytes) -> int | None:
        """The ready slot holding ``block_hash``, or None."""
        with self._lock:
            return self._index.get(block_hash)

    def lookup_many(self, block_hashes: Iterable[bytes]) -> list[int | None]:
        """:meth:`lookup` of each hash under one lock acquisition (a long chain at once)."""
        with self._lock:
            get = self._index.get
            return [get(h) for h in block_hashes]

    def match_prefix(self, block_hashes: Iterable[bytes], *, touch: bool = True) -> list[int]:
        """Slots of the longest leading run of ``block_hashes`` that are ready on host.

        Prefix-cache hits need an unbroken chain from the first block, so the scan stops at the
        first miss. ``touch`` marks the hits most recently used.
        """
        slots: list[int] = []
        with self._lock:
            for h in block_hashes:
                slot = self._index.get(h)
                if slot is None:
                    break
                slots.append(slot)
            if touch:
                self._touch(slots)
        return slots

    def saves_most_of(self, block_hashes: Sequence[bytes]) -> bool:
        """Whether at least half of a chain is ready on host from its first block (a load can
        resume it; the spatial score's saved credit). Touches nothing."""
        if not block_hashes:
            return False
        return 2 * len(self.match_prefix(block_hashes, touch=False)) >= len(block_hashes)

    # --------------------------------------------------------------- mutation
    def allocate(self, n: int, owner: str, victims: Iterable[int] = ()) -> list[int]:
        """Take ``n`` slots for a copy in progress (state ``filling``, pinned by ``owner``).

        Free slots first, then the least recently used unowned ready slots (their hashes are
        dropped), then — only as many as still needed, in the given order — ``victims``: ready
        slots the caller may take from their owners (copies of sessions predicted to return later;
        the caller vouches that no copy reads them). A victim that is not ``ready`` is skipped.
        All or nothing: raises :class:`HostPoolExhausted` if ``n`` slots cannot be had.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if not owner:
            raise ValueError("allocate needs a non-empty owner id")
        with self._lock:
            usable = [v for v in dict.fromkeys(victims) if self._state[self._check(v)] == "ready"]
            usable = [v for v in usable if v not in self._lru]  # unowned ones are in the LRU already
            available = len(self._free) + len(self._lru)
            if n > available + len(usable):
                self._counts["exhausted"] += 1
                raise HostPoolExhausted(
                    f"host pool cannot provide {n} blocks: {len(self._free)} free, "
                    f"{len(self._lru)} reclaimable, {self.num_blocks} total "
                    f"({self.num_blocks - available} pinned by active stalls or copies in flight); "
                    "raise host_pool_blocks / host_pool_gib"
                )
            slots: list[int] = []
            while len(slots) < n and self._free:
                slots.append(self._free.popleft())
            while len(slots) < n and self._lru:
                slot, _ = self._lru.popitem(last=False)
                self._drop_hash(slot)
                self._counts["reclaimed"] += 1
                slots.append(slot)
            for slot in usable[: n - len(slots)]:
                for other in list(self._owners.get(slot, ())):
                    self._remove_owner(slot, other)
                self._lru.pop(slot, None)
                self._drop_hash(slot)
                self._counts["preempted"] += 1
                slots.append(slot)
            for slot in slots:
                self._state[slot] = "filling"
                self._filling += 1
                self._add_owner(slot, owner)
            self._counts["allocated"] += n
            return slots

    def commit(self, block_hash: bytes, slot: int) -> int:
        """Publish a filled slot under ``block_hash`` once its copy is confirmed; returns the slot in use.

        If another slot already holds the same hash (two sessions offloaded a shared prefix), this
        slot is freed, its owners move to the existing slot, and the existing slot is returned.
        """
        if not isinstance(block_hash, (bytes, bytearray)) or not block_hash:
            raise ValueError("commit needs a non-empty bytes block hash")
        block_hash = bytes(block_hash)
        with self._lock:
            self._check(slot)
            if self._state[slot] != "filling":
                raise ValueError(f"slot {slot} is {self._state[slot]}, only a filling slot can be committed")
            existing = self._index.get(block_hash)
            if existing is not None:
                owners = set(self._owners.get(slot, ()))
                self._release_slot(slot)
                for owner in owners:
                    self._add_owner(existing, owner)
                self._counts["deduplicated"] += 1
                return existing
            self._state[slot] = "ready"
            self._filling -= 1
            self._hash[slot] = block_hash
            self._index[block_hash] = slot
            if slot not in self._owners:
                self._lru[slot] = None
            self._counts["committed"] += 1
            return slot

    def invalidate(self, slot: int) -> None:
        """Stop serving a slot (failed copy, corrupt block): back to the free list, except a ready
        slot somebody still owns — another copy may be reading it, and a new offload written into
        it meanwhile would reach that copy's device block. That one only loses its hash (no lookup
        finds it again) and is reused once its last owner lets go, as after :meth:`reset`."""
        with self._lock:
            self._check(slot)
            if self._state[slot] == "free":
                return
            if self._state[slot] == "ready" and slot in self._owners:
                if self._hash[slot] is None:
                    return  # already invalidated, waiting for its owners
                self._drop_hash(slot)
            else:
                self._release_slot(slot)
            self._counts["invalidated"] += 1

    def drop(self, block_hash: bytes) -> bool:
        """Invalidate the ready slot of ``block_hash`` if any (e.g. a load of it failed): no lookup
        finds it again; it is reused at once, or when its owners release it (:meth:`invalidate`)."""
        with self._lock:
            slot = self._index.get(block_hash)
            if slot is None:
                return False
            self.invalidate(slot)
            return True

    def touch(self, slots: Iterable[int]) -> None:
        """Mark slots most recently used (only affects unowned ready slots)."""
        with self._lock:
            self._touch(slots)

    def pin(self, slot: int, owner: str) -> None:
        """Add ``owner`` to a filling or ready slot: it will not be reclaimed until unpinned."""
        if not owner:
            raise ValueError("pin needs a non-empty owner id")
        with self._lock:
            self._check(slot)
            if self._state[slot] == "free":
                raise ValueError(f"slot {slot} is free; pin only filling or ready slots")
            self._add_owner(slot, owner)

    def pin_many(self, slots: Iterable[int], owner: str) -> None:
        with self._lock:
            for slot in slots:
                self.pin(slot, owner)

    def unpin(self, slot: int, owner: str) -> None:
        with self._lock:
            self._check(slot)
            self._remove_owner(slot, owner)

    def release(self, owner: str) -> int:
        """Unpin every slot ``owner`` holds (stall ended, expired or failed); returns how many.

        Released ready slots stay cached and become LRU-reclaimable in the reverse of the order
        the owner pinned them: a chain is pinned head first, so its tail is reclaimed first and
        its prefix stays matchable longest (a tier loses a chain's tail before its head). Filling
        slots stay filling (their copy decides: :meth:`commit` or :meth:`invalidate`).
        """
        with self._lock:
            slots = list(reversed(self._owned.get(owner, {})))
            for slot in slots:
                self._remove_owner(slot, owner)
            return len(slots)

    def reset(self) -> int:
        """Forget every host copy (the KV they hold is no longer valid); returns how many.

        Unowned ready slots go back to the free list. Owned ones (a load may be reading them) lose
        their hash so no lookup finds them, and become plain reclaimable slots once released.
        Filling slots are left to their copy's owner, who must not :meth:`commit` them.
        """
        with self._lock:
            dropped = 0
            for slot in range(self.num_blocks):
                if self._state[slot] != "ready":
                    continue
                dropped += 1
                if slot in self._owners:
                    self._drop_hash(slot)
                else:
                    self._release_slot(slot)
            self._counts["reset_dropped"] = self._counts.get("reset_dropped", 0) + dropped
            return dropped

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "num_blocks": self.num_blocks,
                "free": len(self._free),
                "ready": len(self._index),
                "filling": self._filling,
                "reclaimable": len(self._lru),
                "owners": len(self._owned),
                **self._counts,
            }

    # ---------------------------------------------------------------- helpers
    def _check(self, slot: int) -> int:
        if not isinstance(slot, int) or not 0 <= slot < self.num_blocks:
            raise ValueError(f"slot {slot!r} out of range [0, {self.num_blocks})")
        return slot

    def _touch(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if slot in self._lru:
                self._lru.move_to_end(slot)

    def _add_owner(self, slot: int, owner: str) -> None:
        self._owners.setdefault(slot, set()).add(owner)
        self._owned.setdefault(owner, {})[slot] = None
        self._lru.pop(slot, None)

    def _remove_owner(self, slot: int, owner: str) -> None:
        owners = self._owners.get(slot)
        if owners is None or owner not in owners:
            return
        owners.discard(owner)
        if not owners:
            del self._owners[slot]
        held = self._owned.get(owner)
        if held is not None:
            held.pop(slot, None)
            if not held:
                del self._owned[owner]
        if not owners and self._state[slot] == "ready":
            self._lru[slot] = None

    def _drop_hash(self, slot: int) -> None:
        h = self._hash[slot]
        if h is not None and self._index.get(h) == slot:
            del self._index[h]
        self._hash[slot] = None

    def _release_slot(self, slot: int) -> None:
        for owner in list(self._owners.get(slot, ())):
            self._remove_owner(slot, owner)
        self._lru.pop(slot, None)
        self._drop_hash(slot)
        self._filling -= self._state[slot] == "filling"
        self._state[slot] = "free"
        self._free.append(slot)
