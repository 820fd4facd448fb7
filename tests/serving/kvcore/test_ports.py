"""The two block pools behind the KV core agree: vLLM's ``BlockPool`` (through the connector's
adapter) and the simulator's ``BlockCache`` (through its adapter) give the same answers to the
same operations — who is cached, who is evicted next, what a reorder or an uncache does."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest

from tokencake.serving.kvcore.ports import DevicePool
from tokencake.sim.cache import BlockCache
from tokencake.sim.device_pool import SimDevicePool

N = 8


def _h(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def _sim() -> DevicePool:
    return SimDevicePool(BlockCache(N))


def _vllm() -> DevicePool:
    pytest.importorskip("vllm")
    from vllm.v1.core.block_pool import BlockPool

    from tokencake.serving.vllm.device_pool import VllmDevicePool

    # vLLM keeps one block back (the null block): N usable blocks as in the simulator.
    return VllmDevicePool(BlockPool(num_gpu_blocks=N + 1, enable_caching=True, hash_block_size=16))


@pytest.fixture(params=["sim", "vllm"])
def pool(request: pytest.FixtureRequest) -> DevicePool:
    make: Callable[[], DevicePool] = _sim if request.param == "sim" else _vllm
    return make()


def _cache_chain(pool: DevicePool, hashes: list[bytes]) -> list:
    blocks = pool.allocate(len(hashes))
    for i, (b, h) in enumerate(zip(blocks, hashes, strict=True)):
        assert pool.register(b, h, (i + 1) * 16)
    return blocks


def _evicted_order(pool: DevicePool, hashes: list[bytes]) -> list[int]:
    """Allocate one block at a time; which of ``hashes`` lost its block at each step."""
    order: list[int] = []
    alive = set(range(len(hashes)))
    for _ in range(pool.num_free()):
        pool.allocate(1)
        for i in sorted(alive):
            if pool.cached(hashes[i]) is None:
                alive.discard(i)
                order.append(i)
    return order


def test_satisfies_the_protocol(pool: DevicePool) -> None:
    assert isinstance(pool, DevicePool)
    assert pool.num_free() == N


def test_register_lookup_and_one_owner_per_hash(pool: DevicePool) -> None:
    (block,) = pool.allocate(1)
    assert block.ref_cnt == 1 and not pool.is_cached(block)
    assert pool.register(block, _h(0), 16)
    assert pool.cached(_h(0)) is block and pool.has_hash(block, _h(0)) and pool.is_cached(block)
    assert pool.block(block.block_id) is block
    (other,) = pool.allocate(1)
    assert not pool.register(other, _h(0), 16)  # another block serves it
    assert not pool.register(block, _h(1), 16)  # it carries a hash already
    pool.release([other, block])
    assert block.ref_cnt == 0 and pool.is_idle_cached(block)
    assert pool.num_free() == N


def test_release_frees_the_tail_first_and_pin_takes_a_block_out(pool: DevicePool) -> None:
    hashes = [_h(i) for i in range(4)]
    blocks = _cache_chain(pool, hashes)
    pool.release(blocks)
    pool.pin([blocks[0]])  # the head is in use: never evicted
    assert pool.num_free() == N - 1
    assert _evicted_order(pool, hashes) == [3, 2, 1]
    assert pool.cached(hashes[0]) is blocks[0]


def test_reorder_front_and_back(pool: DevicePool) -> None:
    a = [_h(i) for i in range(3)]
    b = [_h(10 + i) for i in range(3)]
    ablocks, bblocks = _cache_chain(pool, a), _cache_chain(pool, b)
    pool.release(ablocks)
    pool.release(bblocks)
    # b's chain first in line (given in eviction order: tail first), a's to the back.
    assert pool.reorder(list(reversed(bblocks)), first=True) == 3
    assert pool.reorder(list(reversed(ablocks)), first=False) == 3
    ids = {blk.block_id for blk in ablocks}
    assert pool.blocks_ahead(ids, limit=100) == 2 + 3  # the two empty blocks, then b's chain
    assert pool.blocks_ahead(ids, limit=4) == 4
    both = a + b
    assert _evicted_order(pool, both) == [5, 4, 3, 2, 1, 0]


def test_reorder_skips_blocks_in_use_and_hashless(pool: DevicePool) -> None:
    blocks = _cache_chain(pool, [_h(0), _h(1)])
    (empty,) = pool.allocate(1)
    pool.release([blocks[1]])
    assert pool.reorder([blocks[0], blocks[1], empty], first=True) == 1


def test_in_eviction_window(pool: DevicePool) -> None:
    hashes = [_h(i) for i in range(4)]
    blocks = _cache_chain(pool, hashes)
    pool.release(blocks)  # free queue: 4 empty blocks, then 3, 2, 1, 0
    wanted = {hashes[1], hashes[2]}.__contains__
    assert pool.in_eviction_window(wanted, 4) == []  # the empty blocks go first
    found = pool.in_eviction_window(wanted, 6)
    assert [b.block_id for b in found] == [blocks[2].block_id, blocks[1].block_id]
    # Skipped blocks are neither found nor counted.
    found = pool.in_eviction_window(wanted, 5, skip={hashes[3], hashes[2]}.__contains__)
    assert [b.block_id for b in found] == [blocks[1].block_id]


def test_uncache_keeps_references_and_queue_place(pool: DevicePool) -> None:
    hashes = [_h(i) for i in range(3)]
    blocks = _cache_chain(pool, hashes)
    pool.release(blocks[1:])
    pool.uncache([blocks[0].block_id, blocks[2].block_id])
    assert pool.cached(hashes[0]) is None and pool.cached(hashes[2]) is None
    assert pool.cached(hashes[1]) is blocks[1]
    assert blocks[0].ref_cnt == 1 and not pool.is_cached(blocks[0])
    assert pool.num_free() == N - 1
