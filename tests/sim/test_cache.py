"""The simulated block pool keeps vLLM's eviction semantics (tokencake/sim/cache.py)."""

from __future__ import annotations

import pytest

from tokencake.sim.cache import BlockCache, CacheFull


def cached_chain(cache: BlockCache, keys: list[bytes]) -> list[int]:
    blocks = cache.allocate(len(keys))
    for b, k in zip(blocks, keys, strict=True):
        assert cache.cache(b, k)
    return blocks


def test_a_freed_chain_loses_its_tail_first_and_a_hit_takes_a_reference() -> None:
    cache = BlockCache(4)
    a = cached_chain(cache, [b"a0", b"a1", b"a2"])
    cache.release(list(reversed(a)))  # a request frees its blocks tail first
    assert cache.match([b"a0", b"a1", b"a2", b"a3"]) == a
    (fresh,) = cache.allocate(1)  # the never-used block is first in the queue
    assert fresh not in a and cache.evictions == 0
    (b,) = cache.allocate(1)  # then the chain's tail
    assert b == a[2] and cache.lookup(b"a2") is None and cache.evictions == 1
    assert cache.match([b"a0", b"a1", b"a2"]) == a[:2]  # the head still hits
    cache.touch(a[:2])
    assert cache.num_free == 0 and cache.ref[a[0]] == 1
    with pytest.raises(CacheFull):
        cache.allocate(1)


def test_move_and_blocks_ahead_follow_the_queue_order() -> None:
    cache = BlockCache(6)
    x = cached_chain(cache, [b"x0", b"x1"])
    y = cached_chain(cache, [b"y0", b"y1"])
    cache.release(list(reversed(x)))
    cache.release(list(reversed(y)))
    # queue: 2 never-used blocks, x1, x0, y1, y0
    assert cache.blocks_ahead(x) == 2 and cache.blocks_ahead(y) == 4
    # y first in line among the cached blocks, tail first; the empty blocks stay ahead (free to take)
    assert cache.move(list(reversed(y)), front=True) == 2
    assert cache.blocks_ahead(y) == 2 and cache.blocks_ahead([y[0]]) == 3 and cache.blocks_ahead(x) == 4
    assert cache.allocate(3)[-1] == y[1] and cache.evictions == 1
    cache.move(x, front=False)
    assert list(cache.free)[-2:] == x
    assert cache.blocks_ahead([y[1]]) is None  # in use: not in the queue
    with pytest.raises(RuntimeError):
        cache.release([y[0]])  # never referenced


def test_freed_blocks_with_no_key_go_first_and_demotion_steps_over_a_bounded_run(monkeypatch) -> None:
    import tokencake.sim.cache as cache_mod

    cache = BlockCache(6)
    x = cached_chain(cache, [b"x0", b"x1"])
    partial = cache.allocate(2)  # a request's last blocks, never full: no key
    cache.release(list(reversed(x)))
    cache.release(partial)
    assert list(cache.free)[:4] == [partial[1], partial[0], *list(cache.free)[2:4]]
    assert all(cache.key[b] is None for b in list(cache.free)[:4])  # 2 never used, 2 partial
    monkeypatch.setattr(cache_mod, "EMPTY_WALK_LIMIT", 3)
    assert cache.move([x[1]], front=True) == 1
    assert cache.blocks_ahead([x[1]]) == 3


def test_queue_positions_survive_renumbering() -> None:
    cache = BlockCache(3)
    blocks = cached_chain(cache, [b"k0", b"k1", b"k2"])
    cache.release(blocks)
    for _ in range(40_000):  # more moves than the order's numbers at one end: renumbered on the way
        cache.move([blocks[0]], front=True)
        cache.move([blocks[2]], front=False)
    assert list(cache.free) == [blocks[0], blocks[1], blocks[2]]
    assert [cache.blocks_ahead([b]) for b in blocks] == [0, 1, 2]
