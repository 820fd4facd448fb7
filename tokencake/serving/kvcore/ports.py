"""What the KV core needs from the engine it runs in, as interfaces.

The core (offload planning, holds, admission rules, prefetch, demand load, copy-job lifecycle)
decides; a backend carries the decisions out. Two backends implement these interfaces: the vLLM
connector (``tokencake/serving/vllm/``: vLLM's ``BlockPool``, workers that copy KV) and the
simulator (``tokencake/sim/``: a block cache and a timed copy engine). Nothing here imports vLLM
or torch.

Operations a :class:`DevicePool` offers:

* lookups: :meth:`~DevicePool.cached` (the block serving a hash), :meth:`~DevicePool.block`,
  :meth:`~DevicePool.num_free`, :meth:`~DevicePool.is_cached`, :meth:`~DevicePool.has_hash`,
  :meth:`~DevicePool.is_idle_cached`;
* references: :meth:`~DevicePool.pin`, :meth:`~DevicePool.release`, :meth:`~DevicePool.allocate`;
* the prefix cache: :meth:`~DevicePool.register`, :meth:`~DevicePool.uncache`;
* the eviction order (the free queue, front evicted first): :meth:`~DevicePool.reorder`,
  :meth:`~DevicePool.blocks_ahead`, :meth:`~DevicePool.in_eviction_window`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["DeviceBlock", "DevicePool", "RequestView"]


@runtime_checkable
class DeviceBlock(Protocol):
    """One device KV block. The same block is always the same object (identity is stable)."""

    @property
    def block_id(self) -> int: ...

    @property
    def ref_cnt(self) -> int:
        """References held on it (0: it sits in the free queue and may be evicted)."""
        ...


@runtime_checkable
class DevicePool(Protocol):
    """The device block pool, keyed by 32-byte block hashes (one KV cache group)."""

    @property
    def num_blocks(self) -> int:
        """Blocks the device holds in all."""
        ...

    def block(self, block_id: int) -> DeviceBlock:
        """The block with this id."""
        ...

    def cached(self, block_hash: bytes) -> DeviceBlock | None:
        """The block the prefix cache serves ``block_hash`` from (None: not cached)."""
        ...

    def num_free(self) -> int:
        """Blocks an allocation may take now (free, cached idle blocks included)."""
        ...

    def is_cached(self, block: DeviceBlock) -> bool:
        """Whether the block carries a hash (a prefix hit may serve it)."""
        ...

    def has_hash(self, block: DeviceBlock, block_hash: bytes) -> bool:
        """Whether the block still carries ``block_hash`` (it was not evicted and reused)."""
        ...

    def is_idle_cached(self, block: DeviceBlock) -> bool:
        """Cached and unreferenced: in the free queue, evictable."""
        ...

    def pin(self, blocks: Sequence[DeviceBlock]) -> None:
        """Take one reference on each block (it leaves the free queue); pair with :meth:`release`."""
        ...

    def release(self, blocks: Sequence[DeviceBlock]) -> None:
        """Drop one reference each. ``blocks`` are in chain order: the tail is freed first, so it
        is evicted before the head."""
        ...

    def allocate(self, n: int) -> list[DeviceBlock]:
        """``n`` fresh blocks (one reference each, no hash), evicting from the free queue's front."""
        ...

    def register(self, block: DeviceBlock, block_hash: bytes, num_tokens: int) -> bool:
        """Publish a block that carries no hash under ``block_hash``. False, changing nothing,
        when the block carries a hash or another block serves this one (one owner per hash)."""
        ...

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Take the blocks out of the prefix cache: their hashes go; references and their place in
        the free queue stay. No request can hit them afterwards."""
        ...

    def reorder(self, blocks: Sequence[DeviceBlock], *, first: bool) -> int:
        """Move idle cached ``blocks`` (given in eviction order) to the front of the free queue,
        behind the hash-less blocks that lead it (``first``), or to its back. Others are skipped.
        Returns how many moved."""
        ...

    def blocks_ahead(self, block_ids: set[int], limit: int) -> int:
        """Free blocks evicted before the first of ``block_ids`` (at most ``limit``)."""
        ...

    def in_eviction_window(
        self,
        wanted: Callable[[bytes], bool],
        n: int,
        skip: Callable[[bytes], bool] | None = None,
    ) -> list[DeviceBlock]:
        """The cached free blocks whose hash is ``wanted`` that would be evicted before ``n``
        other free blocks, front first. Blocks whose hash is ``skip`` are neither found nor
        counted."""
        ...


class RequestView(Protocol):
    """A request as the core reads it (vLLM's ``Request`` has these attributes; so does the
    simulator's). The core never mutates it."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int:
        """Prompt plus the output generated so far."""
        ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV the engine has computed (or loaded) so far."""
        ...

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """The hash of each full block of ``num_tokens``, in order (a prefix chain)."""
        ...

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        """Connector parameters the client sent (``tokencake`` carries the SDK's metadata)."""
        ...
