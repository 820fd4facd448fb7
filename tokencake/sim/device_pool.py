"""The simulator's block cache as the KV core's :class:`~tokencake.serving.kvcore.ports.DevicePool`.

The core addresses blocks as objects with a ``block_id`` and a live ``ref_cnt``; the cache keeps
plain lists indexed by block id. One view object per block id, made once, so a block is always the
same object (the core groups blocks by identity).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from tokencake.sim.cache import BlockCache

__all__ = ["SimBlock", "SimDevicePool"]


class SimBlock:
    """Block ``block_id`` of a :class:`BlockCache`, as the core sees it."""

    __slots__ = ("block_id", "cache")

    def __init__(self, cache: BlockCache, block_id: int) -> None:
        self.cache = cache
        self.block_id = block_id

    @property
    def ref_cnt(self) -> int:
        return self.cache.ref[self.block_id]

    def __repr__(self) -> str:
        return f"SimBlock({self.block_id}, ref={self.ref_cnt})"


class SimDevicePool:
    """A thin adapter over :class:`BlockCache` (see ``kvcore.ports.DevicePool`` for the contract)."""

    def __init__(self, cache: BlockCache) -> None:
        self.cache = cache
        self._blocks = [SimBlock(cache, i) for i in range(cache.num_blocks)]
        self._by_key = cache.by_key  # the cache keeps this dict for its lifetime

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def block(self, block_id: int) -> SimBlock:
        return self._blocks[block_id]

    def cached(self, block_hash: bytes) -> SimBlock | None:
        b = self._by_key.get(block_hash)  # the core's hottest call: no attribute chain
        return None if b is None else self._blocks[b]

    def num_free(self) -> int:
        return self.cache.num_free

    def is_cached(self, block: SimBlock) -> bool:
        return self.cache.key[block.block_id] is not None

    def has_hash(self, block: SimBlock, block_hash: bytes) -> bool:
        return self.cache.key[block.block_id] == block_hash

    def is_idle_cached(self, block: SimBlock) -> bool:
        return self.cache.is_idle_cached(block.block_id)

    def pin(self, blocks: Sequence[SimBlock]) -> None:
        self.cache.touch([b.block_id for b in blocks])

    def release(self, blocks: Sequence[SimBlock]) -> None:
        self.cache.release([b.block_id for b in reversed(blocks)])

    def allocate(self, n: int) -> list[SimBlock]:
        return [self._blocks[b] for b in self.cache.allocate(n)]

    def register(self, block: SimBlock, block_hash: bytes, num_tokens: int) -> bool:
        return self.cache.cache(block.block_id, block_hash)

    def uncache(self, block_ids: Iterable[int]) -> None:
        self.cache.uncache(block_ids)

    def reorder(self, blocks: Sequence[SimBlock], *, first: bool) -> int:
        return self.cache.move([b.block_id for b in blocks], front=first)

    def blocks_ahead(self, block_ids: set[int], limit: int) -> int:
        ahead = self.cache.blocks_ahead(block_ids)
        return min(self.cache.num_free if ahead is None else ahead, limit)

    def in_eviction_window(
        self,
        wanted: Callable[[bytes], bool],
        n: int,
        skip: Callable[[bytes], bool] | None = None,
    ) -> list[SimBlock]:
        found: list[SimBlock] = []
        others = 0
        keys = self.cache.key
        for b in self.cache.free:
            if others >= n:
                break
            k = keys[b]
            if k is not None and skip is not None and skip(k):  # type: ignore[arg-type]
                continue
            if k is not None and wanted(k):  # type: ignore[arg-type]
                found.append(self._blocks[b])
            else:
                others += 1
        return found
