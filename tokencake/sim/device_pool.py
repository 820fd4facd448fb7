"""The simulator's block cache as the KV core's :class:`~tokencake.serving.kvcore.ports.DevicePool`.

The cache's blocks already read as the core's ``DeviceBlock`` (:class:`~tokencake.sim.cache.Block`:
one object per id, ``block_id`` and a live ``ref_cnt``), so this adapter only maps the pool's
operations onto the cache's; the prefix-cache lookup, the core's most frequent call (every chain
walk), is the cache's own dict lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from tokencake.sim.cache import Block, BlockCache

__all__ = ["SimDevicePool"]


class SimDevicePool:
    """A thin adapter over :class:`BlockCache` (see ``kvcore.ports.DevicePool`` for the contract)."""

    def __init__(self, cache: BlockCache) -> None:
        self.cache = cache
        #: ``cached(block_hash)``: the block the prefix cache serves ``block_hash`` from, or None.
        self.cached: Callable[[bytes], Block | None] = cache.by_key.get

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def block(self, block_id: int) -> Block:
        return self.cache.blocks[block_id]

    def num_free(self) -> int:
        return self.cache.num_free

    def is_cached(self, block: Block) -> bool:
        return self.cache.key[block] is not None

    def has_hash(self, block: Block, block_hash: bytes) -> bool:
        return self.cache.key[block] == block_hash

    def is_idle_cached(self, block: Block) -> bool:
        return self.cache.is_idle_cached(block)

    def pin(self, blocks: Sequence[Block]) -> None:
        self.cache.touch(blocks)

    def release(self, blocks: Sequence[Block]) -> None:
        self.cache.release(list(reversed(blocks)))

    def allocate(self, n: int) -> list[Block]:
        return self.cache.allocate(n)

    def register(self, block: Block, block_hash: bytes, num_tokens: int) -> bool:
        return self.cache.cache(block, block_hash)

    def uncache(self, block_ids: Iterable[int]) -> None:
        self.cache.uncache(block_ids)

    def reorder(self, blocks: Sequence[Block], *, first: bool) -> int:
        return self.cache.move(blocks, front=first)

    def blocks_ahead(self, block_ids: set[int], limit: int) -> int:
        ahead = self.cache.blocks_ahead(block_ids)
        return min(self.cache.num_free if ahead is None else ahead, limit)

    def in_eviction_window(
        self,
        wanted: Callable[[bytes], bool],
        n: int,
        skip: Callable[[bytes], bool] | None = None,
    ) -> list[Block]:
        found: list[Block] = []
        others = 0
        keys = self.cache.key
        for b in self.cache.free:
            if others >= n:
                break
            k = keys[b]
            if k is not None and skip is not None and skip(k):  # type: ignore[arg-type]
                continue
            if k is not None and wanted(k):  # type: ignore[arg-type]
                found.append(b)
            else:
                others += 1
        return found
