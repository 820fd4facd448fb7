"""Every touch of vLLM's device ``BlockPool`` the connector makes, in one place.

Most of it is public API of ``vllm.v1.core.block_pool.BlockPool`` (``get_cached_block``,
``touch``, ``get_new_blocks``, ``free_blocks``, ``get_num_free_blocks``). One call is not:
registering a prefetched block in the prefix cache has no public single-block entry point
(``cache_full_blocks`` wants a request). We use ``BlockPool._insert_block_hash`` — the same
private call vLLM's own ``SimpleCPUOffloadConnector`` makes on its host pool. It is only
allowed on the vLLM versions :data:`SUPPORTED` lists and only if its signature still matches
(:func:`check`); otherwise prefetch is switched off and demand load (public hooks only) stays.
``tests/serving/vllm/test_blockpool_drift.py`` fails when any assumption below changes.

Assumptions (vLLM 0.32):

* prefix-cache keys are ``BlockHashWithGroupId`` = 32-byte block hash + 4-byte big-endian
  group id (``make_block_hash_with_group_id``); a bare hash silently misses;
* ``get_new_blocks(n)`` pops from the LRU end of the free queue (evicting cached blocks
  there), returns blocks with ``ref_cnt == 1`` and no hash;
* ``free_blocks`` appends blocks that carry a hash to the MRU end of the free queue (evicted
  last) and prepends hash-less ones; ``touch`` takes a ref and removes a ref-0 block from it;
* ``_insert_block_hash(key, block, num_tokens)`` sets the block's hash and maps key → block;
* ``free_block_queue`` (a ``FreeKVCacheBlockQueue``: eviction pops from its front) has
  ``remove(block)``, ``prepend_n(blocks)`` and ``append_n(blocks)``. :func:`reorder` uses them to
  put an offloaded session's idle blocks first in line for eviction (``free_blocks`` alone can
  only put them last; ``free_blocks`` prepends hash-less blocks, so empty blocks lead the queue and
  a demoted block goes behind them). Like prefetch, reordering is off when :func:`check` fails.
* ``reset_prefix_cache`` replaces ``cached_block_hash_to_block`` with a new map, and nothing else
  does: :func:`cache_epoch` tells a device prefix-cache reset that vLLM did not pass on to the
  connector (read only; on another version where the attribute is gone, no reset is seen).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import vllm
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

#: vLLM version prefixes whose private internals were checked against this module.
SUPPORTED: tuple[str, ...] = ("0.32.",)
_INSERT_PARAMS = ("block_hash_with_group_id", "block", "num_tokens")
_QUEUE_METHODS = ("remove", "prepend_n", "append_n")


def check() -> str | None:
    """None when the private internals can be used; else a one-line reason why not."""
    version = getattr(vllm, "__version__", "?")
    if not version.startswith(SUPPORTED):
        return f"vllm {version} not in supported versions {SUPPORTED}"
    from vllm.v1.core.block_pool import BlockPool

    fn = getattr(BlockPool, "_insert_block_hash", None)
    if fn is None:
        return "BlockPool._insert_block_hash is gone"
    params = tuple(inspect.signature(fn).parameters)[1:]
    if params != _INSERT_PARAMS:
        return f"BlockPool._insert_block_hash signature changed: {params}"
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    for name in _QUEUE_METHODS:
        if not callable(getattr(FreeKVCacheBlockQueue, name, None)):
            return f"FreeKVCacheBlockQueue.{name} is gone"
    return None


#: A prefix-cache key is the block hash followed by this many bytes of group id.
GROUP_ID_BYTES = 4


def key(block_hash: bytes, group_id: int = 0) -> bytes:
    """The prefix-cache key of one block hash in KV cache group ``group_id``."""
    return make_block_hash_with_group_id(block_hash, group_id)  # type: ignore[arg-type]


def cached_block(pool: BlockPool, block_hash: bytes, group_id: int = 0) -> KVCacheBlock | None:
    """The device block currently cached under ``block_hash`` (None when evicted)."""
    found = pool.get_cached_block(block_hash, [group_id])  # type: ignore[arg-type]
    return found[0] if found else None


def cached_chain(pool: BlockPool, hashes: Sequence[bytes], group_id: int = 0) -> list[KVCacheBlock | None]:
    """For each hash, its cached device block or None."""
    return [cached_block(pool, h, group_id) for h in hashes]


def pin(pool: BlockPool, blocks: Sequence[KVCacheBlock]) -> None:
    """Take one reference on each block so nothing evicts or reuses it (pair with :func:`release`)."""
    pool.touch(list(blocks))


def release(pool: BlockPool, blocks: Sequence[KVCacheBlock]) -> None:
    """Drop one reference each; given in chain order, the tail is freed first (evicted first)."""
    pool.free_blocks(list(reversed(blocks)))


def allocate(pool: BlockPool, n: int) -> list[KVCacheBlock]:
    """``n`` fresh blocks (ref 1, no hash); may evict the least recently used cached blocks."""
    return pool.get_new_blocks(n)


def uncache(pool: BlockPool, block_ids: Iterable[int]) -> None:
    """Take ``block_ids`` out of the prefix cache (their hashes go; references and the free queue
    stay): no request can hit them again. Public ``BlockPool.evict_blocks``, what vLLM itself does
    to blocks whose load failed under its ``fail`` policy."""
    ids = set(block_ids)
    if ids:
        pool.evict_blocks(ids)


def cache_epoch(pool: BlockPool) -> object:
    """An object that stays the same until vLLM resets ``pool``'s prefix cache (compare with
    ``is``, holding the old one: a new epoch never shares its identity while it is held)."""
    return getattr(pool, "cached_block_hash_to_block", None)


def num_free(pool: BlockPool) -> int:
    return pool.get_num_free_blocks()


def usage(pool: BlockPool) -> float:
    return float(pool.get_usage())


def is_idle_cached(block: KVCacheBlock) -> bool:
    """Cached (has a hash), unused (ref 0): sits in the free queue, evictable."""
    return block.ref_cnt == 0 and block.block_hash is not None and not block.is_null


#: How many empty blocks at the front of the free queue :func:`reorder` steps over at most.
EMPTY_WALK_LIMIT = 1024


def reorder(pool: BlockPool, blocks: Sequence[KVCacheBlock], *, first: bool) -> int:
    """Move idle cached ``blocks`` to the front (``first``: evicted next) or back of the free queue.

    ``first`` puts them behind the empty (hash-less) blocks at the front — those cost nothing to
    take, so they go before any cached block — and ahead of every other cached block (at most
    :data:`EMPTY_WALK_LIMIT` empty blocks are stepped over: with more free, nothing is evicted
    soon anyway). ``blocks`` are given in eviction order (the first one is evicted first).
    Blocks in use or without a hash are skipped. Private API (see the module doc); returns how
    many moved.
    """
    seen: set[int] = set()
    moved: list[KVCacheBlock] = []
    for b in blocks:
        if b.block_id not in seen and is_idle_cached(b):
            seen.add(b.block_id)
            moved.append(b)
    if not moved:
        return 0
    queue = pool.free_block_queue
    for b in moved:
        queue.remove(b)
    if first:
        empty = _leading_empty(pool, EMPTY_WALK_LIMIT)
        for b in empty:
            queue.remove(b)
        queue.prepend_n(moved)
        queue.prepend_n(empty)
    else:
        queue.append_n(moved)
    return len(moved)


def _leading_empty(pool: BlockPool, limit: int) -> list[KVCacheBlock]:
    """The hash-less blocks at the front of the free queue, front first (at most ``limit``)."""
    queue = pool.free_block_queue
    block, tail = queue.fake_free_list_head.next_free_block, queue.fake_free_list_tail
    out: list[KVCacheBlock] = []
    while block is not None and block is not tail and block.block_hash is None and len(out) < limit:
        out.append(block)
        block = block.next_free_block
    return out


def blocks_ahead(pool: BlockPool, block_ids: set[int], limit: int) -> int:
    """How many free blocks vLLM evicts before the first of ``block_ids`` (at most ``limit``)."""
    queue = pool.free_block_queue
    block, tail, n = queue.fake_free_list_head.next_free_block, queue.fake_free_list_tail, 0
    while block is not None and block is not tail and n < limit:
        if block.block_id in block_ids:
            return n
        n += 1
        block = block.next_free_block
    return n


def in_eviction_window(
    pool: BlockPool,
    wanted: Callable[[bytes], bool],
    n: int,
    skip: Callable[[bytes], bool] | None = None,
) -> list[KVCacheBlock]:
    """The cached free blocks whose block hash is ``wanted`` that vLLM would evict before ``n``
    other free blocks, front first (O(window)). Blocks whose hash is ``skip`` (the admitting
    request's own prefix hits: vLLM takes them out of the queue before it allocates) are
    stepped over: neither found nor counted."""
    queue = pool.free_block_queue
    block, tail = queue.fake_free_list_head.next_free_block, queue.fake_free_list_tail
    found: list[KVCacheBlock] = []
    others = 0
    while block is not None and block is not tail and others < n:
        h = block.block_hash
        bare = bytes(h)[:-GROUP_ID_BYTES] if h is not None else None
        if bare is not None and skip is not None and skip(bare):
            pass
        elif bare is not None and wanted(bare):
            found.append(block)
        else:
            others += 1
        block = block.next_free_block
    return found


def eviction_rank(pool: BlockPool, limit: int | None = None) -> dict[int, int]:
    """Block id → position in the free queue (0 = evicted next), for the first ``limit`` blocks."""
    out: dict[int, int] = {}
    block = pool.free_block_queue.fake_free_list_head.next_free_block
    tail = pool.free_block_queue.fake_free_list_tail
    while block is not None and block is not tail and (limit is None or len(out) < limit):
        out[block.block_id] = len(out)
        block = block.next_free_block
    return out


def register(
    pool: BlockPool, block: KVCacheBlock, block_hash: bytes, num_tokens: int, group_id: int = 0
) -> bool:
    """Publish ``block`` in the prefix cache under ``block_hash`` (private API; see module doc).

    Returns False (and changes nothing) when the block already carries a hash or another
    block already serves this hash, so the cache never holds two owners for one hash.
    """
    if block.block_hash is not None or block.is_null:
        return False
    if cached_block(pool, block_hash, group_id) is not None:
        return False
    pool._insert_block_hash(key(block_hash, group_id), block, num_tokens=num_tokens)  # type: ignore[arg-type]
    return True


def has_hash(block: KVCacheBlock, block_hash: bytes, group_id: int = 0) -> bool:
    """Whether ``block`` still holds the KV of ``block_hash`` (it was not evicted and reused)."""
    return block.block_hash == key(block_hash, group_id)


def find_engine_wakeup() -> Callable[[], None] | None:
    """A thread-safe callback that makes an idle EngineCore run one step, or None.

    An idle engine blocks on its input queue, so events that arrive meanwhile (a stall begin
    that should offload now, a prefetch that falls due) would wait for the next request. The
    connector is built inside ``EngineCore.__init__`` after ``EngineCoreProc`` created
    ``input_queue``; we find that object on the call stack and put the engine's own no-op
    ``WAKEUP`` request into it (what vLLM's shutdown signal handler does). The engine then
    steps if the connector reports pending work (``has_pending_push_work``). Private: only on
    :data:`SUPPORTED` versions; None elsewhere (events then wait for the next step).
    """
    if check() is not None:
        return None
    try:
        from vllm.v1.engine import EngineCoreRequestType
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, EngineCoreProc):
            q = getattr(owner, "input_queue", None)
            if q is None or not hasattr(q, "put_nowait"):
                return None
            request = (EngineCoreRequestType.WAKEUP, None)
            return lambda: q.put_nowait(request)
        frame = frame.f_back
    return None


__all__ = [
    "SUPPORTED",
    "allocate",
    "blocks_ahead",
    "cache_epoch",
    "cached_block",
    "cached_chain",
    "check",
    "eviction_rank",
    "find_engine_wakeup",
    "has_hash",
    "in_eviction_window",
    "is_idle_cached",
    "key",
    "num_free",
    "pin",
    "register",
    "release",
    "reorder",
    "usage",
]
