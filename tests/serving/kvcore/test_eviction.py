"""``EvictionOrder``: demoted chains' place in the free queue, whatever the string hash seed."""

from __future__ import annotations

from tokencake.serving.kvcore.core import KVCore
from tokencake.serving.kvcore.records import Stall
from tokencake.sim.cache import BlockCache
from tokencake.sim.device_pool import SimDevicePool

BS = 4


def _core() -> tuple[KVCore, BlockCache]:
    core = KVCore(block_size=BS, block_bytes=64, num_host_blocks=64)
    cache = BlockCache(64)
    core.bind_pool(SimDevicePool(cache))
    return core, cache


def _idle_stall(core: KVCore, cache: BlockCache, session: str, predicted_s: float) -> Stall:
    """An offloaded stall whose two-block chain is idle on device and saved on host."""
    hashes = tuple(f"{session}-{i}".encode() for i in range(2))
    blocks = cache.allocate(len(hashes))
    for b, h in zip(blocks, hashes, strict=True):
        cache.cache(b, h)
    cache.release(list(reversed(blocks)))
    for h, slot in zip(hashes, core.host.allocate(len(hashes), f"job:{session}"), strict=True):
        core.host.commit(h, slot)
    stall = Stall(f"st-{session}", session, "worker", "search", 0.0, predicted_s, hashes, offloaded=True)
    core.stalls.add(stall)
    return stall


def _queued_sessions(cache: BlockCache) -> list[str]:
    """The sessions of the cached blocks in the free queue, front (evicted first) to back, once each."""
    keys = [cache.key[b] for b in cache.free if cache.key[b] is not None]
    return list(dict.fromkeys(k.decode().split("-")[0] for k in keys))  # type: ignore[union-attr]


def test_a_requeue_keeps_tied_chains_in_the_order_they_were_demoted() -> None:
    """Chains that tie on their eviction rank (same predicted return) keep the order demoting them
    one at a time gave (the latest demoted in front) when a chain that returns sooner makes the
    whole queue go again — not the order of a hash-seeded set."""
    core, cache = _core()
    sooner = _idle_stall(core, cache, "x", 5.0)
    tied = [_idle_stall(core, cache, f"s{i}", 10.0) for i in range(8)]
    for stall in tied:
        core.eviction.demote(stall)
    one_at_a_time = [s.session_id for s in reversed(tied)]
    assert _queued_sessions(cache) == [*one_at_a_time, "x"]  # x: not demoted, its blocks used last
    core.eviction.demote(sooner)  # not evicted first: every demoted chain is queued again
    assert _queued_sessions(cache) == [*one_at_a_time, "x"]
