"""vLLM's device ``BlockPool`` as the KV core's :class:`~tokencake.serving.kvcore.ports.DevicePool`.

Every call goes through :mod:`tokencake.serving.vllm._blockpool`, the one module that touches the
pool (and its private internals, behind a version check and a drift test). vLLM's ``KVCacheBlock``
objects are the core's blocks as they are: vLLM keeps one object per block id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from tokencake.serving.vllm import _blockpool as bp

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

__all__ = ["VllmDevicePool"]


class VllmDevicePool:
    """A thin adapter: one line per operation (see ``kvcore.ports.DevicePool`` for the contract)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    @property
    def num_blocks(self) -> int:
        return self.pool.num_gpu_blocks

    def block(self, block_id: int) -> KVCacheBlock:
        return self.pool.blocks[block_id]

    def cached(self, block_hash: bytes) -> KVCacheBlock | None:
        return bp.cached_block(self.pool, block_hash)

    def num_free(self) -> int:
        return bp.num_free(self.pool)

    def is_cached(self, block: KVCacheBlock) -> bool:
        return block.block_hash is not None

    def has_hash(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        return bp.has_hash(block, block_hash)

    def is_idle_cached(self, block: KVCacheBlock) -> bool:
        return bp.is_idle_cached(block)

    def pin(self, blocks: Sequence[KVCacheBlock]) -> None:
        bp.pin(self.pool, blocks)

    def release(self, blocks: Sequence[KVCacheBlock]) -> None:
        bp.release(self.pool, blocks)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        return bp.allocate(self.pool, n)

    def register(self, block: KVCacheBlock, block_hash: bytes, num_tokens: int) -> bool:
        return bp.register(self.pool, block, block_hash, num_tokens)

    def uncache(self, block_ids: Iterable[int]) -> None:
        bp.uncache(self.pool, block_ids)

    def reorder(self, blocks: Sequence[KVCacheBlock], *, first: bool) -> int:
        return bp.reorder(self.pool, blocks, first=first)

    def blocks_ahead(self, block_ids: set[int], limit: int) -> int:
        return bp.blocks_ahead(self.pool, block_ids, limit)

    def in_eviction_window(
        self,
        wanted: Callable[[bytes], bool],
        n: int,
        skip: Callable[[bytes], bool] | None = None,
    ) -> list[KVCacheBlock]:
        return bp.in_eviction_window(self.pool, wanted, n, skip)
