from __future__ import annotations

import tracemalloc

import pytest

from tokencake.serving.host_pool import HostPool, HostPoolExhausted, blocks_for_gib


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def fill(pool: HostPool, owner: str, hashes: list[bytes]) -> list[int]:
    slots = pool.allocate(len(hashes), owner)
    return [pool.commit(x, s) for x, s in zip(hashes, slots, strict=True)]


def test_allocate_commit_lookup() -> None:
    pool = HostPool(4)
    slots = pool.allocate(2, "stall-1")
    assert len(set(slots)) == 2
    assert [pool.state(s) for s in slots] == ["filling", "filling"]
    assert pool.lookup(h(1)) is None  # not visible before the copy is confirmed
    assert pool.commit(h(1), slots[0]) == slots[0]
    assert pool.lookup(h(1)) == slots[0]
    assert pool.state(slots[0]) == "ready"
    assert pool.hash_of(slots[0]) == h(1)
    assert pool.owners(slots[0]) == {"stall-1"}
    assert (pool.num_free, pool.num_ready, pool.num_filling) == (2, 1, 1)


def test_victims_are_taken_last_in_order_and_only_when_ready() -> None:
    pool = HostPool(4)
    a = fill(pool, "late", [h(1), h(2), h(3)])
    filling = pool.allocate(1, "job:9")  # a copy in flight
    # Nothing free or reclaimable: the victims are taken in the given order, as many as needed;
    # a filling slot is never taken, whatever the caller lists.
    with pytest.raises(HostPoolExhausted):
        pool.allocate(4, "job:10", victims=[*filling, a[2], a[1], a[0]])
    assert pool.lookup(h(3)) is not None  # all or nothing: nothing was taken
    got = pool.allocate(2, "job:10", victims=[*filling, a[2], a[1], a[0]])
    assert got == [a[2], a[1]]
    assert pool.lookup(h(3)) is None and pool.lookup(h(2)) is None and pool.lookup(h(1)) == a[0]
    assert pool.owners(a[2]) == {"job:10"} and pool.owned_by("late") == [a[0]]
    assert pool.stats()["preempted"] == 2 and pool.state(filling[0]) == "filling"


def test_owned_slots_are_never_reclaimed() -> None:
    pool = HostPool(2)
    fill(pool, "s1", [h(1), h(2)])
    assert pool.available == 0
    with pytest.raises(HostPoolExhausted, match="0 free, 0 reclaimable, 2 total"):
        pool.allocate(1, "s2")
    assert pool.stats()["exhausted"] == 1
    assert pool.lookup(h(1)) is not None  # nothing was lost


def test_lru_reclaim_of_released_slots() -> None:
    pool = HostPool(3)
    a = fill(pool, "s1", [h(1)])
    b = fill(pool, "s2", [h(2)])
    c = fill(pool, "s3", [h(3)])
    assert pool.release("s1") == 1
    assert pool.release("s2") == 1
    pool.release("s3")
    assert pool.num_reclaimable == 3
    pool.touch(a)  # h(1) is now the most recently used: h(2) goes first
    got = pool.allocate(2, "s4")
    assert sorted(got) == sorted(b + c)
    assert pool.lookup(h(2)) is None and pool.lookup(h(3)) is None
    assert pool.lookup(h(1)) == a[0]
    assert pool.stats()["reclaimed"] == 2


def test_a_released_chain_loses_its_tail_first() -> None:
    pool = HostPool(4)
    chain = [bytes([i]) * 32 for i in range(4)]
    for slot, h in zip(pool.allocate(4, "stall:a"), chain, strict=True):  # pinned head first
        pool.commit(h, slot)
    pool.release("stall:a")
    assert pool.allocate(1, "stall:b") == [3]
    assert pool.match_prefix(chain) == [0, 1, 2]


def test_a_release_follows_the_pin_order_not_the_slot_numbers() -> None:
    pool = HostPool(6)
    for slot in pool.allocate(6, "y"):
        pool.commit(bytes([slot]) * 32, slot)
    pool.release("y")
    for slot in (3, 0, 4):
        pool.pin(slot, "x")
    pool.unpin(0, "x")
    pool.pin(0, "x")
    pool.release("x")  # pinned 3, 4, 0: released 0, 4, 3
    assert pool.allocate(6, "z") == [5, 2, 1, 0, 4, 3]  # y released tail (5) first


def test_free_slots_before_reclaim() -> None:
    pool = HostPool(3)
    a = fill(pool, "s1", [h(1)])
    pool.release("s1")
    got = pool.allocate(2, "s2")
    assert a[0] not in got
    assert pool.lookup(h(1)) == a[0]


def test_allocation_is_all_or_nothing() -> None:
    pool = HostPool(3)
    pool.allocate(2, "s1")
    with pytest.raises(HostPoolExhausted):
        pool.allocate(2, "s2")
    assert pool.num_free == 1
    assert pool.owned_by("s2") == []


def test_pins_from_several_owners() -> None:
    pool = HostPool(2)
    (slot,) = fill(pool, "stall-a", [h(1)])
    pool.pin(slot, "stall-b")  # a second session shares the prefix block
    pool.release("stall-a")
    assert pool.num_reclaimable == 0
    pool.unpin(slot, "stall-b")
    assert pool.num_reclaimable == 1
    pool.unpin(slot, "never-owned")  # unknown owner: no-op
    assert pool.num_reclaimable == 1


def test_pin_free_slot_rejected() -> None:
    pool = HostPool(2)
    with pytest.raises(ValueError, match="free"):
        pool.pin(0, "s")
    with pytest.raises(ValueError, match="out of range"):
        pool.pin(5, "s")


def test_commit_deduplicates_shared_prefix() -> None:
    pool = HostPool(4)
    (first,) = fill(pool, "s1", [h(1)])
    (dup,) = pool.allocate(1, "s2")
    assert pool.commit(h(1), dup) == first
    assert pool.state(dup) == "free"
    assert pool.owners(first) == {"s1", "s2"}
    assert pool.owned_by("s2") == [first]
    assert pool.stats()["deduplicated"] == 1


def test_commit_requires_filling_slot() -> None:
    pool = HostPool(2)
    with pytest.raises(ValueError, match="filling"):
        pool.commit(h(1), 0)
    (slot,) = fill(pool, "s", [h(1)])
    with pytest.raises(ValueError, match="filling"):
        pool.commit(h(2), slot)


def test_invalidate_failed_copy() -> None:
    pool = HostPool(2)
    slots = pool.allocate(2, "s1")
    pool.commit(h(1), slots[0])
    pool.invalidate(slots[1])  # the copy of the second block failed: freed at once
    assert pool.num_free == 1 and pool.owned_by("s1") == [slots[0]]
    pool.invalidate(slots[0])  # ready and still owned: unpublished now, reused after release
    assert pool.lookup(h(1)) is None and pool.num_free == 1
    assert pool.stats()["invalidated"] == 2
    pool.invalidate(slots[0])  # idempotent
    assert pool.stats()["invalidated"] == 2
    pool.release("s1")
    assert pool.available == 2 and pool.owned_by("s1") == []
    assert sorted(pool.allocate(2, "s2")) == sorted(slots)


def test_drop_by_hash() -> None:
    pool = HostPool(2)
    fill(pool, "s", [h(1)])
    pool.release("s")
    assert pool.drop(h(1)) is True
    assert pool.drop(h(1)) is False
    assert pool.num_free == 2


def test_a_dropped_slot_another_copy_still_reads_is_not_handed_out() -> None:
    # A prefetch (job:2) pins a ready slot; the session's demand load of the same block fails and
    # drops it. A new offload must not get that slot while the prefetch may still be reading it.
    pool = HostPool(1)
    (slot,) = fill(pool, "job:1", [h(1)])
    pool.release("job:1")
    pool.pin(slot, "job:2")
    assert pool.drop(h(1)) is True
    assert pool.lookup(h(1)) is None
    with pytest.raises(HostPoolExhausted):
        pool.allocate(1, "job:3")
    pool.release("job:2")
    assert pool.allocate(1, "job:3") == [slot]


def test_match_prefix_stops_at_first_miss() -> None:
    pool = HostPool(4)
    slots = fill(pool, "s", [h(1), h(2), h(4)])
    assert pool.match_prefix([h(1), h(2), h(3), h(4)]) == slots[:2]
    assert pool.match_prefix([h(9), h(1)]) == []


def test_release_leaves_filling_slots_filling() -> None:
    pool = HostPool(1)
    (slot,) = pool.allocate(1, "s")
    pool.release("s")
    assert pool.state(slot) == "filling"
    assert pool.available == 0  # a copy in flight is never handed out again
    pool.commit(h(1), slot)
    assert pool.num_reclaimable == 1


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        HostPool(-1)
    pool = HostPool(1)
    with pytest.raises(ValueError, match="owner"):
        pool.allocate(1, "")
    with pytest.raises(ValueError):
        pool.allocate(-1, "s")
    assert pool.allocate(0, "s") == []


def test_blocks_for_gib() -> None:
    assert blocks_for_gib(1.0, 1 << 20) == 1024
    assert blocks_for_gib(0.0, 1 << 20) == 0
    with pytest.raises(ValueError):
        blocks_for_gib(1.0, 0)
    with pytest.raises(ValueError):
        blocks_for_gib(-1.0, 10)


def test_bookkeeping_bytes_per_slot_are_bounded() -> None:
    """Per-slot overhead is fixed by the pool size: ~60 B empty, under 320 B with every slot ready."""
    n = 20_000
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        pool = HostPool(n)
        empty, _ = tracemalloc.get_traced_memory()
        for start in range(0, n, 500):
            owner = f"job:{start}"
            for slot in pool.allocate(500, owner):
                pool.commit(start.to_bytes(4, "little") + slot.to_bytes(28, "little"), slot)
            pool.release(owner)
        full, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert pool.num_ready == n and pool.stats()["owners"] == 0
    assert (empty - base) / n < 100, (empty - base) / n
    assert (full - base) / n < 320, (full - base) / n


def test_lookup_many_is_lookup_of_each() -> None:
    pool = HostPool(3)
    (slot,) = pool.allocate(1, "o")
    pool.commit(b"h1", slot)
    assert pool.lookup_many([b"h0", b"h1", b"h2"]) == [None, slot, None]
    assert pool.lookup_many([]) == []


def test_preemption_victims_latest_return_first_tail_first_and_only_theirs() -> None:
    from tokencake.serving.host_pool import preemption_victims

    pool = HostPool(8)
    late = fill(pool, "late", [h(1), h(2), h(3)])
    later = fill(pool, "later", [h(11), h(12)])
    shared = fill(pool, "soon", [h(21)])[0]
    pool.pin(later[0], "soon")  # a stall returning sooner also needs this one
    cands = [(10.0, "late", [h(1), h(2), h(3)]), (20.0, "later", [h(11), h(12), h(21)])]
    got = preemption_victims(pool, cands)
    assert got == [later[1], late[2], late[1], late[0]]  # latest return first, each tail first
    assert shared not in got and later[0] not in got
    assert preemption_victims(pool, cands, limit=2) == [later[1], late[2]]
    assert preemption_victims(pool, cands, own={h(12)}, skip={late[2]}) == [late[1], late[0]]
