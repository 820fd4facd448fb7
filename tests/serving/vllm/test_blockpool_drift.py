"""Drift test: fails when a vLLM internal the connector relies on changes (see ``_blockpool.py``).

Each test pins one assumption written in ``tokencake/serving/vllm/_blockpool.py`` against the
installed vLLM, with a real ``BlockPool``. When one fails after a vLLM upgrade, re-check the
module, then add the version to ``_blockpool.SUPPORTED``.
"""

from __future__ import annotations

import hashlib
import inspect

import pytest

vllm = pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from tokencake.serving.vllm import _blockpool as bp  # noqa: E402


def _hash(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)


def test_version_supported_and_private_signature() -> None:
    assert bp.check() is None, bp.check()
    params = list(inspect.signature(BlockPool._insert_block_hash).parameters)
    assert params == ["self", "block_hash_with_group_id", "block", "num_tokens"]


def test_key_is_hash_plus_big_endian_group_id() -> None:
    h = _hash(1)
    assert make_block_hash_with_group_id(h, 3) == h + (3).to_bytes(4, "big")
    assert bp.key(h, 3) == h + b"\x00\x00\x00\x03"


def test_allocate_register_lookup_free(pool: BlockPool) -> None:
    (block,) = bp.allocate(pool, 1)
    assert block.ref_cnt == 1 and block.block_hash is None
    h = _hash(0)
    assert bp.register(pool, block, h, num_tokens=16)
    assert bp.cached_block(pool, h) is block and bp.has_hash(block, h)
    # A bare hash (without the group id) must miss: that is why the key helper exists.
    assert pool.cached_block_hash_to_block.get_one_block(h) is None
    # A second block for the same hash is refused (one owner per hash).
    (other,) = bp.allocate(pool, 1)
    assert not bp.register(pool, other, h, num_tokens=16)
    bp.release(pool, [other])
    # Freed with a hash: stays cached at ref 0, at the MRU end (allocated last).
    free_before = bp.num_free(pool)
    bp.release(pool, [block])
    assert block.ref_cnt == 0 and bp.num_free(pool) == free_before + 1
    taken = bp.allocate(pool, bp.num_free(pool))
    assert taken[-1] is block, "a freed cached block must be evicted last"
    # Allocation evicted it: the hash is gone and the block is clean again.
    assert bp.cached_block(pool, h) is None and block.block_hash is None
    bp.release(pool, taken)


def test_pin_takes_a_ref_and_leaves_the_free_queue(pool: BlockPool) -> None:
    (block,) = bp.allocate(pool, 1)
    bp.register(pool, block, _hash(5), num_tokens=16)
    bp.release(pool, [block])
    free = bp.num_free(pool)
    bp.pin(pool, [block])
    assert block.ref_cnt == 1 and bp.num_free(pool) == free - 1
    bp.release(pool, [block])
    assert block.ref_cnt == 0 and bp.num_free(pool) == free
    assert bp.cached_block(pool, _hash(5)) is block  # pin/unpin keeps the cache entry


def test_release_frees_chain_tail_first(pool: BlockPool) -> None:
    blocks = bp.allocate(pool, 3)
    for i, b in enumerate(blocks):
        bp.register(pool, b, _hash(10 + i), num_tokens=16 * (i + 1))
    bp.release(pool, blocks)
    order = pool.free_block_queue.get_all_free_blocks()
    ids = [b.block_id for b in order]
    # Tail (block 2 of the chain) is evicted before the head (block 0).
    assert ids.index(blocks[2].block_id) < ids.index(blocks[1].block_id) < ids.index(blocks[0].block_id)


def test_reorder_moves_idle_cached_blocks_to_either_end(pool: BlockPool) -> None:
    blocks = bp.allocate(pool, 4)
    for i, b in enumerate(blocks):
        bp.register(pool, b, _hash(20 + i), num_tokens=16 * (i + 1))
    bp.release(pool, blocks)
    empty = bp.num_free(pool) - 4  # never used: no hash, at the front of the queue
    assert empty == 3
    # Freed cached blocks sit at the back (evicted last); demoting two puts them behind the empty
    # blocks (free to take) and ahead of every other cached block, in order.
    assert bp.reorder(pool, [blocks[3], blocks[2]], first=True) == 2
    rank = bp.eviction_rank(pool)
    assert rank[blocks[3].block_id] == empty and rank[blocks[2].block_id] == empty + 1
    assert all(b.block_hash is None for b in pool.free_block_queue.get_all_free_blocks()[:empty])
    taken = bp.allocate(pool, empty + 1)
    assert all(b.block_hash is None for b in taken[:-1]), "empty blocks go before any cached one"
    assert taken[-1] is blocks[3], "the demoted block must be the first cached block evicted"
    # Promoting sends the block to the very back; blocks in use or without a hash never move.
    assert bp.reorder(pool, [blocks[2]], first=False) == 1
    assert max(bp.eviction_rank(pool).items(), key=lambda kv: kv[1])[0] == blocks[2].block_id
    bp.pin(pool, [blocks[0]])
    assert bp.reorder(pool, [blocks[0]], first=True) == 0
    bp.release(pool, [blocks[0], *taken])
    assert pool.free_block_queue.num_free_blocks == bp.num_free(pool) == 7


def test_demoting_steps_over_a_bounded_number_of_empty_blocks(pool: BlockPool, monkeypatch) -> None:
    blocks = bp.allocate(pool, 2)
    for i, b in enumerate(blocks):
        bp.register(pool, b, _hash(30 + i), num_tokens=16 * (i + 1))
    bp.release(pool, blocks)
    monkeypatch.setattr(bp, "EMPTY_WALK_LIMIT", 2)  # 5 empty blocks lead; step over 2 of them
    assert bp.reorder(pool, [blocks[1]], first=True) == 1
    assert bp.eviction_rank(pool)[blocks[1].block_id] == 2
    assert pool.free_block_queue.num_free_blocks == bp.num_free(pool) == 7


def test_the_eviction_window_is_walked_from_the_front(pool: BlockPool) -> None:
    blocks = bp.allocate(pool, 3)
    for i, b in enumerate(blocks):
        bp.register(pool, b, _hash(40 + i), num_tokens=16 * (i + 1))
    bp.release(pool, blocks)
    empty = bp.num_free(pool) - 3
    bp.reorder(pool, [blocks[1], blocks[0]], first=True)  # empty ones, 1, 0, then 2 last
    wanted = {_hash(40), _hash(42)}.__contains__  # blocks 0 and 2, by their bare block hash
    # The empty blocks count as others: they are taken first.
    assert bp.in_eviction_window(pool, wanted, empty) == []
    # Then block 1 is next but not asked for; block 0 and block 2 follow with no other between.
    assert bp.in_eviction_window(pool, wanted, empty + 1) == []
    assert bp.in_eviction_window(pool, wanted, empty + 2) == [blocks[0], blocks[2]]
    assert bp.in_eviction_window(pool, wanted, bp.num_free(pool)) == [blocks[0], blocks[2]]


def test_engine_wakeup_path_exists() -> None:
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCoreProc

    assert hasattr(EngineCoreRequestType, "WAKEUP")
    src = inspect.getsource(EngineCoreProc.__init__)
    # input_queue exists before EngineCore.__init__ (which builds the scheduler and our connector).
    assert src.index("self.input_queue") < src.index("super().__init__(")
    handle = inspect.getsource(EngineCoreProc._handle_client_request)
    assert "EngineCoreRequestType.WAKEUP" in handle
    # Outside an engine there is nothing to wake.
    assert bp.find_engine_wakeup() is None


def test_scheduler_reads_failure_policy_after_building_connector() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    src = inspect.getsource(Scheduler.__init__)
    assert src.index("KVConnectorFactory.create_connector(") < src.index("kv_load_failure_policy")


def test_connector_hooks_keep_their_signatures() -> None:
    from tokencake.serving.vllm.connector import TokenCakeConnector

    for name in (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
        "start_load_kv",
        "register_kv_caches",
        "bind_gpu_block_pool",
        "on_new_request",
        "has_pending_push_work",
        "get_block_ids_with_load_errors",
        "build_connector_worker_meta",
    ):
        base = list(inspect.signature(getattr(KVConnectorBase_V1, name)).parameters)
        ours = list(inspect.signature(getattr(TokenCakeConnector, name)).parameters)
        assert ours == base, name


def test_uncache_drops_the_hash_and_keeps_references_and_the_free_queue(pool: BlockPool) -> None:
    """``uncache`` (public ``evict_blocks``): a block in use loses its hash but not its reference;
    an idle cached one stays where it was in the free queue, hash-less (nothing can hit it)."""
    held, idle = bp.allocate(pool, 2)
    for i, block in enumerate((held, idle)):
        assert bp.register(pool, block, _hash(10 + i), num_tokens=16)
    bp.release(pool, [idle])
    free_before = bp.num_free(pool)
    bp.uncache(pool, [held.block_id, idle.block_id])
    assert bp.cached_block(pool, _hash(10)) is None and bp.cached_block(pool, _hash(11)) is None
    assert held.block_hash is None and held.ref_cnt == 1
    assert idle.block_hash is None and idle.ref_cnt == 0 and bp.num_free(pool) == free_before
    bp.release(pool, [held])


def test_the_cache_epoch_changes_with_a_prefix_cache_reset_only(pool: BlockPool) -> None:
    """``cache_epoch``: a device prefix-cache reset vLLM did not pass on to the connector is told
    by the pool's hash map being replaced — by a successful reset, and by nothing else."""
    epoch = bp.cache_epoch(pool)
    assert epoch is not None
    blocks = bp.allocate(pool, 3)
    for i, block in enumerate(blocks):
        assert bp.register(pool, block, _hash(20 + i), num_tokens=16 * (i + 1))
    bp.uncache(pool, [blocks[0].block_id])
    assert not pool.reset_prefix_cache()  # refused: blocks in use
    bp.release(pool, blocks)
    bp.release(pool, bp.allocate(pool, bp.num_free(pool)))  # evicts every cached block
    assert bp.cache_epoch(pool) is epoch
    assert pool.reset_prefix_cache()
    assert bp.cache_epoch(pool) is not epoch
