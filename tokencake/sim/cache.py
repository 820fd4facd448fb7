"""The device KV cache as vLLM v1's block pool keeps it: blocks, references, a prefix map, an LRU.

Same semantics as ``vllm/v1/core/block_pool.py`` where they decide who gets evicted: a block with no
reference sits in the free queue (front = evicted first) and keeps its prefix key until it is
re-allocated; a freed block with a key joins the back, one without (a partial last block) the front,
so empty blocks are taken before any cached one; a request frees its blocks tail first, so a chain's
tail is evicted before its head;
a prefix hit takes a reference (the block leaves the free queue). Keys are opaque hashables (the
simulator uses ``(session or prefix group, block index)``).

A block is a :class:`Block`: its id as an int (the cache indexes its tables with it) that also
reads as the KV core's ``DeviceBlock``, one object per id, so ``by_key`` answers the core's
prefix-cache lookups directly (``device_pool.py``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

__all__ = ["EMPTY_WALK_LIMIT", "Block", "BlockCache", "CacheFull"]

#: How many empty blocks at the front of the free queue ``move(front=True)`` steps over at most
#: (the connector's ``_blockpool.EMPTY_WALK_LIMIT``).
EMPTY_WALK_LIMIT = 1024


class CacheFull(RuntimeError):
    """Asked for more blocks than the free queue holds."""


class Block(int):
    """Block ``block_id`` of a :class:`BlockCache` (an int equal to its id)."""

    block_id: int
    cache: BlockCache

    def __new__(cls, block_id: int, cache: BlockCache) -> Block:
        block = super().__new__(cls, block_id)
        block.block_id = block_id
        block.cache = cache
        return block

    @property
    def ref_cnt(self) -> int:
        """References held on it (0: it sits in the free queue)."""
        return self.cache.ref[self.block_id]

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt})"


class _Order:
    """Positions in the free queue in O(log n): a Fenwick tree over enqueue sequence numbers.

    Appends take increasing numbers, prepends decreasing ones, so the queue's order is the order
    of the numbers; ``ahead(seq)`` counts the queued entries with a smaller number. Numbers run out
    after ``capacity / 2`` operations at one end: then the queue is renumbered (rare).
    """

    def __init__(self, capacity: int) -> None:
        self.n = capacity
        self.tree = [0] * (capacity + 1)
        self.back = capacity // 2
        self.front = capacity // 2 - 1

    def add(self, i: int, delta: int) -> None:
        i += 1
        tree, n = self.tree, self.n
        while i <= n:
            tree[i] += delta
            i += i & -i

    def ahead(self, i: int) -> int:
        total, tree = 0, self.tree
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total


class BlockCache:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.key: list[Hashable | None] = [None] * num_blocks
        #: Block id -> its one :class:`Block` object.
        self.blocks = [Block(i, self) for i in range(num_blocks)]
        self.by_key: dict[Hashable, Block] = {}
        self.free: OrderedDict[Block, None] = OrderedDict()
        self.evictions = 0
        self.seq = [0] * num_blocks
        self._order = _Order(max(1 << 16, 8 * num_blocks))
        for b in self.blocks:
            self._push(b, front=False)

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def lookup(self, key: Hashable) -> Block | None:
        return self.by_key.get(key)

    def match(self, keys: Iterable[Hashable]) -> list[Block]:
        """The cached blocks of the longest prefix of ``keys`` (a hit needs an unbroken chain)."""
        out = []
        for k in keys:
            b = self.by_key.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def is_idle_cached(self, block: int) -> bool:
        return self.ref[block] == 0 and self.key[block] is not None

    def blocks_ahead(self, blocks: Iterable[int]) -> int | None:
        """Free blocks vLLM would evict before the first of ``blocks`` that is free (None: none is)."""
        free = self.free
        seqs = [self.seq[b] for b in blocks if b in free]
        return self._order.ahead(min(seqs)) if seqs else None

    # ------------------------------------------------------------------ the free queue
    def _push(self, b: int, *, front: bool) -> None:
        b = self.blocks[b]  # the queue holds the block objects (``allocate`` hands them out)
        order = self._order
        if order.back >= order.n or order.front < 0:
            self._renumber()
            order = self._order
        if front:
            self.seq[b] = order.front
            order.front -= 1
            self.free[b] = None
            self.free.move_to_end(b, last=False)
        else:
            self.seq[b] = order.back
            order.back += 1
            self.free[b] = None
        order.add(self.seq[b], 1)

    def _pop(self, b: int) -> None:
        del self.free[b]
        self._order.add(self.seq[b], -1)

    def _renumber(self) -> None:
        queued = list(self.free)
        self._order = order = _Order(max(1 << 16, 8 * self.num_blocks, 4 * len(queued)))
        start = order.n // 2 - len(queued) // 2
        for i, b in enumerate(queued):
            self.seq[b] = start + i
            order.add(start + i, 1)
        order.back, order.front = start + len(queued), start - 1

    # ------------------------------------------------------------------ changes
    def allocate(self, n: int) -> list[Block]:
        """``n`` fresh blocks (one reference each), evicting from the front of the free queue."""
        if n > len(self.free):
            raise CacheFull(f"{n} blocks asked, {len(self.free)} free")
        out = []
        for _ in range(n):
            b = next(iter(self.free))
            self._pop(b)
            k = self.key[b]
            if k is not None:
                if self.by_key.get(k) == b:
                    del self.by_key[k]
                self.key[b] = None
                self.evictions += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on each block (a hit, a pin): it leaves the free queue."""
        for b in blocks:
            if self.ref[b] == 0 and b in self.free:
                self._pop(b)
            self.ref[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference each, in the given order (freed cached blocks join the queue's back,
        blocks with no key its front)."""
        for b in blocks:
            if self.ref[b] <= 0:
                raise RuntimeError(f"block {b} released more often than referenced")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self._push(b, front=self.key[b] is None)

    def cache(self, block: int, key: Hashable) -> bool:
        """Give ``block`` its prefix key (False when another block already serves that key)."""
        if key in self.by_key or self.key[block] is not None:
            return False
        self.key[block] = key
        self.by_key[key] = self.blocks[block]
        return True

    def uncache(self, blocks: Iterable[int]) -> None:
        """Drop the blocks' prefix keys (no hit can serve them); references and their place in
        the free queue stay (vLLM's ``BlockPool.evict_blocks``)."""
        for b in blocks:
            k = self.key[b]
            if k is not None:
                if self.by_key.get(k) == b:
                    del self.by_key[k]
                self.key[b] = None

    def move(self, blocks: Iterable[int], *, front: bool) -> int:
        """Idle cached ``blocks`` to the front (evicted next: behind the empty blocks that lead the
        queue, at most ``EMPTY_WALK_LIMIT`` of them, as the connector's ``reorder``) or back of
        the free queue, in order."""
        moved = [b for b in dict.fromkeys(blocks) if self.is_idle_cached(b)]
        for b in moved:
            self._pop(b)
        if front:
            empty = list(
                itertools.islice(
                    itertools.takewhile(lambda b: self.key[b] is None, self.free), EMPTY_WALK_LIMIT
                )
            )
            for b in empty:
                self._pop(b)
            for b in reversed(empty + moved):
                self._push(b, front=True)
        else:
            for b in moved:
                self._push(b, front=False)
        return len(moved)
