"""Scheduler-side connector logic against a real vLLM ``BlockPool`` (no engine, no model).

Requests are stand-ins with the attributes the connector reads; the worker is simulated by
answering each copy job with a :class:`TokenCakeWorkerMeta`. Every test ends by checking that
no device block is left pinned (each allocation/pin paired with exactly one release).
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool

from tokencake.events import StallBegin, StallEnd
from tokencake.serving.vllm import _blockpool as bp
from tokencake.serving.vllm._scheduler import Options, SchedulerSide
from tokencake.serving.vllm.metadata import JobResult, TokenCakeMetadata, TokenCakeWorkerMeta

BS = 4  # tokens per block
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


def request(req_id: str, hashes: list[bytes], num_tokens: int, session: str | None = "run:A") -> Any:
    params = {"tokencake": {"session_id": session, "run_id": "run", "node": "A"}} if session else None
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=hashes,
        num_tokens=num_tokens,
        num_computed_tokens=0,
        kv_transfer_params=params,
    )


def begin(stall_id: str = "s1", session: str = "run:A", predicted: float | None = 10.0) -> StallBegin:
    return StallBegin(
        stall_id=stall_id,
        session_id=session,
        run_id="run",
        node="A",
        tool="search",
        predicted_s=predicted,
        ts=0,
    )


def end(stall_id: str = "s1", session: str = "run:A", duration: float = 1.0) -> StallEnd:
    return StallEnd(
        stall_id=stall_id,
        session_id=session,
        run_id="run",
        node="A",
        tool="search",
        duration_s=duration,
        ts=0,
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, hash_block_size=BS)


def make_side(pool: BlockPool, clock: Clock, host_blocks: int = 8, **opts: Any) -> SchedulerSide:
    options = Options(usage_threshold=0.0, prefetch_reserve_frac=0.0, **opts)  # always "under pressure"
    side = SchedulerSide(
        block_size=BS, block_bytes=1000, num_host_blocks=host_blocks, options=options, clock=clock
    )
    side.bind_pool(pool)
    return side


def finish_turn(side: SchedulerSide, pool: BlockPool, hashes: list[bytes], req_id: str = "r1") -> list[Any]:
    """A request of session run:A computed ``len(hashes)`` full blocks and finished (blocks cached)."""
    req = request(req_id, hashes, len(hashes) * BS + 2)
    side.on_new_request(req)
    blocks = bp.allocate(pool, len(hashes))
    for i, (b, h) in enumerate(zip(blocks, hashes, strict=True)):
        bp.register(pool, b, h, (i + 1) * BS)
    req.num_computed_tokens = len(hashes) * BS + 1
    side.request_finished(req)
    bp.release(pool, blocks)
    return blocks


def answer(side: SchedulerSide, meta: TokenCakeMetadata, ok: bool = True) -> None:
    side.on_worker_meta(TokenCakeWorkerMeta({j.job_id: JobResult(ok, 0.001, 0) for j in meta.jobs}))


def evict_all(pool: BlockPool) -> None:
    bp.release(pool, bp.allocate(pool, bp.num_free(pool)))


def assert_no_pins(pool: BlockPool) -> None:
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:]), [b for b in pool.blocks[1:] if b.ref_cnt]


def test_offload_commits_after_confirmation_and_unpins(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    hashes = chain("a", 3)
    blocks = finish_turn(side, pool, hashes)
    ack = side.handle_event(begin())
    assert ack.ok and ack.status == "recorded"
    meta = side.build_meta()
    (job,) = meta.jobs
    assert job.kind == "offload" and job.device_blocks == [b.block_id for b in blocks]
    assert all(b.ref_cnt == 1 for b in blocks)  # pinned while the copy runs
    assert side.host.lookup(hashes[0]) is None  # not visible before the copy is confirmed
    answer(side, meta)
    assert all(side.host.lookup(h) is not None for h in hashes)
    assert_no_pins(pool)
    assert side.stats.counter("offload.blocks") == 3


def test_failed_offload_leaves_nothing_on_host(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    hashes = chain("f", 2)
    finish_turn(side, pool, hashes)
    side.handle_event(begin())
    answer(side, side.build_meta(), ok=False)
    assert side.host.lookup(hashes[0]) is None and side.host.num_free == 8
    assert side.stats.counter("offload.failed") == 1
    assert_no_pins(pool)


def test_demand_load_counts_host_hits_past_device_prefix(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("d", 4)
    finish_turn(side, pool, hashes)
    side.handle_event(begin())
    answer(side, side.build_meta())
    evict_all(pool)
    side.handle_event(end())
    side.build_meta()
    # Next turn: 4 old blocks + 1 new block + 2 tokens; device has nothing, host has 4 blocks.
    req = request("r2", [*hashes, *chain("new", 1)], 5 * BS + 2)
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 0) == 4 * BS
    # With one block already on device, only the next 3 come from the host.
    assert side.get_num_new_matched_tokens(req, BS) == 3 * BS
    side.get_num_new_matched_tokens(req, 0)
    allocated = bp.allocate(pool, 6)
    ids = [b.block_id for b in allocated]
    side.update_state_after_alloc(req, ids, 4 * BS)
    (job,) = side.build_meta().jobs
    assert job.kind == "load" and job.device_blocks == ids[:4] and job.req_id == "r2"
    assert job.host_slots == [side.host.lookup(h) for h in hashes]
    answer(side, TokenCakeMetadata([job]))
    assert side.stats.counter("tokens.from_host") == 4 * BS
    assert side.stats.counter("next_turn.prefix_tokens_recomputed") == 0
    bp.release(pool, allocated)
    assert_no_pins(pool)


def test_demand_load_leaves_one_token_to_compute(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("e", 3)
    finish_turn(side, pool, hashes)
    side.handle_event(begin())
    answer(side, side.build_meta())
    # A prompt that is exactly the 3 cached blocks: at most 2 may be loaded (a token must remain).
    req = request("r2", hashes, 3 * BS)
    assert side.get_num_new_matched_tokens(req, 0) == 2 * BS


def test_prefetch_restores_the_device_prefix_cache(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    hashes = chain("p", 3)
    finish_turn(side, pool, hashes)
    side.handle_event(begin(predicted=5.0))
    answer(side, side.build_meta())
    evict_all(pool)
    assert bp.cached_block(pool, hashes[0]) is None
    assert side.build_meta().jobs == []  # not due yet
    clock.t += 5.0  # predicted end reached (lead ≈ 0.25 s)
    meta = side.build_meta()
    (job,) = meta.jobs
    assert job.kind == "prefetch" and len(job.device_blocks) == 3
    assert bp.cached_block(pool, hashes[0]) is None  # published only after the copy
    answer(side, meta)
    found = [bp.cached_block(pool, h) for h in hashes]
    assert all(b is not None for b in found)
    assert [b.block_id for b in found] == job.device_blocks
    assert_no_pins(pool)
    # The session's next turn hits on device: on time, nothing recomputed.
    side.handle_event(end())
    side.build_meta()
    req = request("r2", [*hashes, *chain("n", 1)], 4 * BS + 1)
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 3 * BS) == 0
    side.update_state_after_alloc(req, [], 0)
    assert side.stats.counter("prefetch.on_time") == 1
    assert side.stats.counter("next_turn.prefix_tokens_device") == 3 * BS


def test_early_end_prefetches_at_once(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    hashes = chain("x", 2)
    finish_turn(side, pool, hashes)
    side.handle_event(begin(predicted=300.0))
    answer(side, side.build_meta())
    evict_all(pool)
    side.handle_event(end())
    (job,) = side.build_meta().jobs
    assert job.kind == "prefetch"
    answer(side, TokenCakeMetadata([job]))
    assert side.stats.counter("prefetch.triggered_by_end") == 1
    assert_no_pins(pool)


def test_prefetch_keeps_headroom_while_requests_wait(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    hashes = chain("h", 2)
    finish_turn(side, pool, hashes)
    side.handle_event(begin(predicted=1.0))
    answer(side, side.build_meta())
    evict_all(pool)
    side.on_new_request(request("waiting", chain("w", 1), 9, session=None))
    clock.t += 2.0
    assert side.build_meta().jobs == []
    assert side.stats.counter("prefetch.deferred.waiting") == 1


def test_unknown_session_and_too_small_host_pool(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, host_blocks=2)
    ack = side.handle_event(begin(session="nobody:A"))
    assert ack.decision == "unknown_session"
    finish_turn(side, pool, chain("big", 4))
    side.handle_event(begin(stall_id="s2"))
    assert side.build_meta().jobs == []
    assert side.stats.counter("stalls.decision.unknown_session") == 1
    assert side.stats.counter("stalls.decision.host_pool_full") == 1
    assert_no_pins(pool)


def test_duplicate_and_out_of_order_events(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    assert side.handle_event(begin()).status == "recorded"
    assert side.handle_event(begin()).status == "duplicate"
    assert side.handle_event(end(stall_id="zzz")).reason == "unknown_stall"


def test_plan_failure_reports_invalid_blocks(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    req = request("r9", chain("q", 3), 13)
    side.fail_load(req, [5, 6, 7, 8], 2 * BS)
    (job,) = side.build_meta().jobs
    assert job.invalid and job.device_blocks == [5, 6]


def test_unconfirmed_jobs_time_out_and_release(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    finish_turn(side, pool, chain("t", 2))
    side.handle_event(begin())
    side.build_meta()
    assert side.has_pending_work()
    clock.t += 120
    side.build_meta()
    assert side.stats.counter("jobs.timed_out") == 1 and not side._jobs
    assert_no_pins(pool)


def test_stall_without_end_expires(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    finish_turn(side, pool, chain("z", 2))
    side.handle_event(begin(predicted=1.0))
    answer(side, side.build_meta())
    assert side.host.num_reclaimable == 0  # pinned by the active stall
    clock.t += 61
    side.build_meta()
    assert side.stats.counter("stalls.expired.no_stall_end") == 1
    assert side.host.num_reclaimable == 2


def test_blocks_lost_while_waiting_keep_the_waiting_reason(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, host_blocks=1)
    finish_turn(side, pool, chain("w", 3))
    side.handle_event(begin(predicted=60.0))
    side.build_meta()
    assert side.stats.counter("stalls.decision.host_pool_full") == 1
    evict_all(pool)  # other traffic evicts the blocks while the gate waits for room
    clock.t += 1.0
    side.build_meta()
    side.handle_event(end())
    side.build_meta()
    assert side.stats.counter("stalls.lost_while_waiting.host_pool_full") == 1
    assert side.stats.counter("stalls.final_decision.host_pool_full") == 1
    assert_no_pins(pool)


def test_a_failing_policy_step_still_ships_planned_loads(
    pool: BlockPool, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    side = make_side(pool, clock)
    req = request("r1", chain("l", 2), 9)
    side.fail_load(req, [3, 4], BS)

    def boom(now: float) -> None:
        raise RuntimeError("policy bug")

    monkeypatch.setattr(side, "_step", boom)
    (job,) = side.build_meta().jobs
    assert job.invalid and side.stats.counter("errors.step") == 1


def test_requests_without_metadata_are_not_tracked(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    req = request("plain", chain("p", 2), 9, session=None)
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 0) == 0
    req.num_computed_tokens = 9
    side.request_finished(req)
    assert side.sessions.stats()["sessions"] == 0
