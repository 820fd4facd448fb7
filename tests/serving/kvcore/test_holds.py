"""``Holds`` and ``HoldCounts``: what releasing holds frees, counted once while nothing changes it."""

from __future__ import annotations

import random

import pytest

from tokencake.serving.kvcore.core import KVCore
from tokencake.serving.kvcore.records import Job
from tokencake.serving.spatial import reserved_sessions
from tokencake.sim.cache import Block, BlockCache
from tokencake.sim.device_pool import SimDevicePool

BS = 4


def _core(blocks: int = 64) -> tuple[KVCore, BlockCache]:
    core = KVCore(block_size=BS, block_bytes=64, num_host_blocks=8)
    cache = BlockCache(blocks)
    core.bind_pool(SimDevicePool(cache))
    return core, cache


def _hold(
    core: KVCore, session: str, blocks: list[Block], *, critical: bool = False, rank: float = 0.0
) -> None:
    core.critical.sessions.put(session, critical, 1)
    core.holds.keep(
        session, [(i, b"", b, None) for i, b in enumerate(blocks)], until=100.0, now=0.0, rank=rank
    )


def _freed_by_releasing(core: KVCore, cache: BlockCache, sessions: list[str]) -> int:
    """Release the sessions' holds, count the blocks that became free, and take them back."""
    held = [core.holds.kept[s].blocks for s in sessions]
    before = cache.num_free
    for blocks in held:
        cache.release(blocks)
    freed = cache.num_free - before
    for blocks in held:
        cache.touch(blocks)
    return freed


def test_the_counts_are_the_blocks_releasing_the_holds_frees() -> None:
    """Holds that share blocks with each other and with running requests: for every set of
    excluded sessions and asking session, ``without`` counts exactly the blocks that releasing
    the other holds together frees."""
    rng = random.Random(7)
    core, cache = _core()
    pool = cache.allocate(40)
    sessions = [f"s{i}" for i in range(6)]
    for s in sessions:
        _hold(core, s, rng.sample(pool, 8))
    cache.release(pool)  # the allocation's references go: only the holds' (and the requests') stay
    cache.touch(rng.sample(pool, 6))  # running requests referencing some of them
    counts = core.holds.counts
    for _ in range(60):
        excluded = frozenset(rng.sample([*sessions, "unheld"], rng.randint(0, 3)))
        own = rng.choice([*sessions, "", "unheld"])
        released = [s for s in sessions if s not in excluded and s != own]
        assert counts.without(excluded, own) == _freed_by_releasing(core, cache, released)


def test_the_reserve_is_the_critical_holds_returning_soonest_that_fit() -> None:
    core, cache = _core()
    pool = cache.allocate(12)
    _hold(core, "late", pool[0:4], critical=True, rank=9.0)
    _hold(core, "soon", pool[4:8], critical=True, rank=1.0)
    _hold(core, "plain", pool[8:12], rank=0.0)
    cache.release(pool)
    want = reserved_sessions([("late", 9.0, 4), ("soon", 1.0, 4)], 6)
    assert core.holds.counts.reserved(6) == want == frozenset({"soon"})


def test_a_count_is_taken_once_while_nothing_changes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    core, cache = _core()
    pool = cache.allocate(8)
    _hold(core, "a", pool[:4])
    _hold(core, "b", pool[4:])
    cache.release(pool)
    counts = core.holds.counts
    walks: list[int] = []
    only = counts._only
    monkeypatch.setattr(counts, "_only", lambda snap: walks.append(1) or only(snap))
    for own in ("a", "b", "c"):  # waiting requests of one pass
        counts.without(frozenset({"b"}), own)
    assert len(walks) == 3  # (each call walks its cached snapshot: the first builds it)
    assert counts._snap is not None and counts._snap.only is not None
    snap = counts._snap
    counts.without(frozenset(), "a")
    assert counts._snap is snap  # the same snapshot, not counted again


@pytest.mark.parametrize(
    "change", ["keep", "unkeep", "offload", "copy_release", "admitted", "allocated", "pass_end", "freed"]
)
def test_whatever_may_change_a_held_blocks_references_drops_the_count(change: str) -> None:
    """The rule in ``HoldCounts``: a hold added, extended or released, an offload's pins and a
    copy's release, an admission that goes on and vLLM's allocation for it (it references the
    request's prefix hits, held ones included), the end of a pass, and (the guard) a free count
    that moved each drop the snapshot. None of these changes moves the free count but the last."""
    core, cache = _core()
    pool = cache.allocate(8)
    _hold(core, "a", pool[:4])
    _hold(core, "b", pool[1:2])  # shares a's second block
    cache.release(pool)
    request = cache.allocate(1)
    cache.touch(pool[:1])  # a running request shares a's first block
    counts = core.holds.counts

    def but_b() -> int:
        return counts.without(frozenset({"b"}), "")

    def offload() -> Job | None:  # a save of a's third block (pinned while it is copied)
        return core.offload.plan_offload([(2, b"h2", pool[2], None)], stall_id=None, session_id="a")

    job = offload() if change == "copy_release" else None
    assert but_b() == (1 if job is not None else 2)
    free = cache.num_free
    if change == "keep":
        _hold(core, "b", pool[2:3])
    elif change == "unkeep":
        core.holds.unkeep("b", "test")
    elif change == "offload":
        offload()
    elif change == "copy_release":
        assert job is not None
        core.copies.release(job)
    elif change == "admitted":
        cache.touch(pool[2:4])  # the admitted request hits two held blocks
        assert core.admit(_Request(), 1)
    elif change == "allocated":
        cache.touch(pool[2:4])
        core.update_state_after_alloc(_Request(), [], 0)
    elif change == "pass_end":
        cache.release(pool[:1])  # the running request finished between passes
        core.observe_step(0, 0.0)
    else:
        cache.release([*request, pool[0]])  # freed with a block of its own: the free count moves
    assert (cache.num_free == free) is (change != "freed")
    expected = {"keep": 1, "unkeep": 3, "offload": 1, "copy_release": 2, "admitted": 0, "allocated": 0}
    expected |= {"pass_end": 3, "freed": 3}
    assert but_b() == expected[change]


class _Request:
    request_id = "r"
    num_tokens = 8
    num_prompt_tokens = 8
    num_output_tokens = 0
    num_computed_tokens = 0
    block_hashes: tuple[bytes, ...] = ()
    kv_transfer_params = None
