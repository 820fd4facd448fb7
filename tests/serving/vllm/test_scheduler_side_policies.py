"""The KV policies carried out on a real vLLM ``BlockPool`` (no engine): every action pins and
releases exactly once, offload-all works without events, keeps are soft, discards go first."""

from __future__ import annotations

import hashlib
import random
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool

from tokencake.events import StallBegin, StallEnd
from tokencake.serving.profile import PrefillProfile
from tokencake.serving.vllm import _blockpool as bp
from tokencake.serving.vllm.metadata import JobResult, TokenCakeMetadata, TokenCakeWorkerMeta
from tokencake.serving.vllm.scheduler_side import Options, SchedulerSide

BS = 4
NUM_BLOCKS = 16


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def chain(tag: str, n: int) -> list[bytes]:
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{tag}{i}".encode()).digest()
        out.append(prev)
    return out


def request(
    req_id: str, hashes: list[bytes], num_tokens: int, session: str | None, tool_s: float | None
) -> Any:
    params = None
    if session is not None:
        meta: dict[str, Any] = {"session_id": session, "run_id": "run", "node": session}
        if tool_s is not None:
            meta["next_stall"] = {"tool": "search", "predicted_s": tool_s}
        params = {"tokencake": meta}
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=hashes,
        num_tokens=num_tokens,
        num_computed_tokens=0,
        kv_transfer_params=params,
    )


def begin(sid: str, session: str, predicted: float) -> StallBegin:
    return StallBegin(
        stall_id=sid,
        session_id=session,
        run_id="run",
        node=session,
        tool="search",
        predicted_s=predicted,
        ts=0,
    )


def end(sid: str, session: str, duration: float) -> StallEnd:
    return StallEnd(
        stall_id=sid, session_id=session, run_id="run", node=session, tool="search", duration_s=duration, ts=0
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, hash_block_size=BS)


def side_for(
    policy: str, pool: BlockPool, clock: Clock, *, s_per_token: float | None = None, **opts: Any
) -> SchedulerSide:
    profile = PrefillProfile(min_tokens=1)
    if s_per_token is not None:
        profile.observe_step(1, s_per_token)
    side = SchedulerSide(
        block_size=BS,
        block_bytes=1000,
        num_host_blocks=opts.pop("host_blocks", 8),
        options=Options(policy=policy, usage_threshold=0.0, prefetch_reserve_frac=0.0, **opts),
        clock=clock,
        profile=profile,
    )
    side.bind_pool(pool)
    return side


def cache_blocks(pool: BlockPool, hashes: list[bytes]) -> list[Any]:
    blocks = bp.allocate(pool, len(hashes))
    for i, (b, h) in enumerate(zip(blocks, hashes, strict=True)):
        bp.register(pool, b, h, (i + 1) * BS)
    return blocks


def finish(
    side: SchedulerSide,
    pool: BlockPool,
    hashes: list[bytes],
    req_id: str,
    session: str | None,
    tool_s: float | None,
) -> list[Any]:
    req = request(req_id, hashes, len(hashes) * BS + 2, session, tool_s)
    side.on_new_request(req)
    side.update_state_after_alloc(req, [], 0)
    blocks = cache_blocks(pool, hashes)
    req.num_computed_tokens = len(hashes) * BS + 1
    side.request_finished(req)
    bp.release(pool, blocks)
    return blocks


def answer(side: SchedulerSide, meta: TokenCakeMetadata, ok: bool = True) -> None:
    side.on_worker_meta(TokenCakeWorkerMeta({j.job_id: JobResult(ok, 0.001, 0) for j in meta.jobs}))


def evict_all(pool: BlockPool) -> None:
    bp.release(pool, bp.allocate(pool, bp.num_free(pool)))


def pinned(pool: BlockPool) -> list[Any]:
    return [b for b in pool.blocks[1:] if b.ref_cnt]


# ------------------------------------------------------------------ offload-all


def test_offload_all_stores_requests_without_metadata_and_loads_them_on_a_miss(
    pool: BlockPool, clock: Clock
) -> None:
    side = side_for("offload-all", pool, clock)
    hashes = chain("o", 3)
    finish(side, pool, hashes, "r1", session=None, tool_s=None)
    meta = side.build_meta()
    (job,) = meta.jobs
    assert job.kind == "offload" and len(job.device_blocks) == 3
    answer(side, meta)
    assert all(side.host.lookup(h) is not None for h in hashes)
    assert not pinned(pool)
    # Nothing reorders vLLM's queue, no stall is planned.
    assert side.stats.counter("evict_order.demoted_blocks") == 0
    evict_all(pool)
    nxt = request("r2", [*hashes, *chain("n", 1)], 4 * BS + 1, None, None)
    side.on_new_request(nxt)
    assert side.get_num_new_matched_tokens(nxt, 0) == 3 * BS
    # The host pool is LRU and unowned: every slot is reclaimable by later stores.
    assert side.host.num_reclaimable == 3


def test_offload_all_ignores_stall_events(pool: BlockPool, clock: Clock) -> None:
    side = side_for("offload-all", pool, clock)
    hashes = chain("e", 2)
    finish(side, pool, hashes, "r1", session="run:A", tool_s=5.0)
    answer(side, side.build_meta())
    side.handle_event(begin("s1", "run:A", 5.0))
    assert side.build_meta().jobs == []
    assert side.stats.counter("stalls.decision.nothing") == 1
    assert not pinned(pool)


# ------------------------------------------------------------------ continuum (keep)


def test_continuum_keeps_the_blocks_for_its_ttl_then_lets_go(pool: BlockPool, clock: Clock) -> None:
    side = side_for("continuum", pool, clock, s_per_token=1.0)  # recompute 8 tokens = 8 s → TTL ln 8 ≈ 2.1 s
    hashes = chain("k", 2)
    blocks = finish(side, pool, hashes, "r1", session="run:A", tool_s=5.0)
    assert [b.ref_cnt for b in blocks] == [1, 1]  # held for the tool call
    evict_all(pool)
    assert all(bp.cached_block(pool, h) is not None for h in hashes)
    clock.t += 1.0
    side.build_meta()
    assert side.stats.counter("keep.sessions") == 1 and len(pinned(pool)) == 2
    clock.t += 1.5  # past the TTL
    side.build_meta()
    assert not pinned(pool)
    assert side.stats.counter("keep.released.ttl") == 1


def test_a_kept_session_is_released_when_its_next_request_is_admitted(pool: BlockPool, clock: Clock) -> None:
    side = side_for("continuum", pool, clock, s_per_token=1.0)
    hashes = chain("a", 2)
    finish(side, pool, hashes, "r1", session="run:A", tool_s=1.0)
    side.handle_event(begin("s1", "run:A", 1.0))
    side.build_meta()
    side.handle_event(end("s1", "run:A", 1.0))
    side.build_meta()
    nxt = request("r2", [*hashes, *chain("n", 1)], 3 * BS + 1, "run:A", None)
    side.on_new_request(nxt)
    assert side.get_num_new_matched_tokens(nxt, 2 * BS) == 0
    held = [bp.cached_block(pool, h) for h in hashes]
    bp.pin(pool, held)  # what vLLM's allocate_slots does for the prefix hit
    side.update_state_after_alloc(nxt, [], 0)
    assert side.stats.counter("keep.released.admitted") == 1
    assert [b.ref_cnt for b in held] == [1, 1]  # only the request's own references remain
    assert side.stats.counter("next_turn.prefix_tokens_device") == 2 * BS
    bp.release(pool, held)
    assert not pinned(pool)


def test_a_keep_never_stops_every_request_from_running(pool: BlockPool, clock: Clock) -> None:
    side = side_for("continuum", pool, clock, s_per_token=1.0)
    finish(side, pool, chain("a", 2), "r1", session="run:A", tool_s=60.0)
    finish(side, pool, chain("b", 2), "r2", session="run:B", tool_s=60.0)
    assert len(pinned(pool)) == 4
    side.on_new_request(request("big", chain("w", 1), 14 * BS, None, None))  # needs the kept blocks
    side.observe_step(0)  # the engine computed nothing this step: it cannot admit anything
    side.build_meta()
    assert side.stats.counter("keep.released.pressure") == 1 and len(pinned(pool)) == 2
    side.observe_step(0)
    side.build_meta()
    assert not pinned(pool)


def test_a_kept_session_that_never_returns_lets_go_soon_after_its_tool(pool: BlockPool, clock: Clock) -> None:
    side = side_for("continuum", pool, clock, s_per_token=100.0, keep_after_end_s=2.0)
    finish(side, pool, chain("a", 2), "r1", session="run:A", tool_s=60.0)
    side.handle_event(begin("s1", "run:A", 60.0))
    side.build_meta()
    side.handle_event(end("s1", "run:A", 1.0))
    side.build_meta()
    assert len(pinned(pool)) == 2
    clock.t += 2.5
    side.build_meta()
    assert not pinned(pool)


def test_reset_cache_and_shutdown_release_keeps(pool: BlockPool, clock: Clock) -> None:
    side = side_for("continuum", pool, clock, s_per_token=1.0)
    finish(side, pool, chain("a", 2), "r1", session="run:A", tool_s=60.0)
    assert side.reset_cache() and not pinned(pool)
    finish(side, pool, chain("b", 2), "r2", session="run:B", tool_s=60.0)
    side.shutdown()
    assert not pinned(pool)


# ------------------------------------------------------------------ infercept


def test_infercept_swaps_a_long_call_and_brings_it_back_when_the_tool_returns(
    pool: BlockPool, clock: Clock
) -> None:
    side = side_for("infercept", pool, clock, s_per_token=1.0)
    hashes = chain("i", 3)
    finish(side, pool, hashes, "r1", session="run:A", tool_s=30.0)
    assert side.stats.counter("policy.finish.offload") == 1
    answer(side, side.build_meta())  # the save started at request_finished
    side.handle_event(begin("s1", "run:A", 30.0))
    side.build_meta()
    evict_all(pool)
    clock.t += 29.0
    assert side.build_meta().jobs == []  # no predictive upload
    side.handle_event(end("s1", "run:A", 29.0))
    (job,) = side.build_meta().jobs
    assert job.kind == "prefetch" and len(job.device_blocks) == 3
    answer(side, TokenCakeMetadata([job]))
    assert side.planner.counts().get("due_at_end") == 1
    assert not pinned(pool)


def test_infercept_discard_puts_the_session_first_in_line(pool: BlockPool, clock: Clock) -> None:
    side = side_for("infercept", pool, clock, s_per_token=1e-6, host_blocks=0)  # recompute is cheap
    hashes = chain("d", 2)
    finish(side, pool, hashes, "r1", session="run:A", tool_s=30.0)
    other = chain("o", 2)
    bp.release(pool, cache_blocks(pool, other))  # idle after A: A would outlive it under LRU
    side.handle_event(begin("s1", "run:A", 30.0))
    side.build_meta()
    assert side.stats.counter("stalls.decision.discard") == 1
    rank = bp.eviction_rank(pool)
    assert sorted(rank[bp.cached_block(pool, h).block_id] for h in hashes) == [0, 1]
    assert not pinned(pool)


# ------------------------------------------------------------------ any decision stays safe


@pytest.mark.parametrize("seed", range(6))
def test_random_decisions_never_leak_a_pin_or_publish_an_unconfirmed_block(
    pool: BlockPool, clock: Clock, seed: int
) -> None:
    rng = random.Random(seed)
    side = side_for("random", pool, clock, policy_seed=seed, host_blocks=10)
    sessions = [f"run:{c}" for c in "ABC"]
    turns = dict.fromkeys(sessions, 0)
    open_stall: dict[str, str] = {}
    pending: list[TokenCakeMetadata] = []
    confirmed: set[bytes] = set()  # hashes of offload copies the worker confirmed

    def settle(meta: TokenCakeMetadata, ok: bool) -> None:
        for j in meta.jobs:
            job = side._jobs.get(j.job_id)
            if ok and job is not None and job.kind == "offload":
                confirmed.update(job.hashes)
        answer(side, meta, ok=ok)

    for _ in range(120):
        s = rng.choice(sessions)
        roll = rng.random()
        if s in open_stall and roll < 0.4:
            side.handle_event(end(open_stall.pop(s), s, rng.uniform(0.1, 5.0)))
        elif s not in open_stall and roll < 0.5 and bp.num_free(pool) >= 4:
            turns[s] += 1
            finish(side, pool, chain(s, rng.randint(1, 3)), f"{s}-{turns[s]}", s, rng.choice([None, 2.0]))
            sid = f"{s}-st{turns[s]}"
            side.handle_event(begin(sid, s, rng.uniform(0.5, 5.0)))
            open_stall[s] = sid
        elif roll < 0.6:
            evict_all(pool)
        clock.t += rng.uniform(0.0, 1.0)
        side.observe_step(rng.choice([0, BS, 8 * BS]))
        pending.append(side.build_meta())
        if rng.random() < 0.7:
            for meta in pending:
                settle(meta, ok=rng.random() < 0.9)
            pending.clear()
        # The host pool only ever serves blocks whose copy a worker confirmed.
        held = {side.host.hash_of(slot) for slot in range(side.host.num_blocks)} - {None}
        assert held <= confirmed
    for meta in pending:
        settle(meta, ok=True)
    side.shutdown()
    assert not pinned(pool), pinned(pool)
    assert not side._jobs
