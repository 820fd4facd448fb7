"""Scheduler-side connector logic against a real vLLM ``BlockPool`` (no engine, no model).

Requests are stand-ins with the attributes the connector reads; the worker is simulated by
answering each copy job with a :class:`TokenCakeWorkerMeta`. Every test ends by checking that
no device block is left pinned (each allocation/pin paired with exactly one release).
"""

from __future__ import annotations

import hashlib
import random
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool

from tokencake.events import StallBegin, StallEnd
from tokencake.serving.kvcore.records import ABANDONED_POLL_S, Keep, stall_owner
from tokencake.serving.profile import PrefillProfile
from tokencake.serving.vllm import _blockpool as bp
from tokencake.serving.vllm.metadata import JobResult, TokenCakeMetadata, TokenCakeWorkerMeta
from tokencake.serving.vllm.scheduler_side import Options, SchedulerSide

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


def request(
    req_id: str,
    hashes: list[bytes],
    num_tokens: int,
    session: str | None = "run:A",
    next_tool: float | None = None,
    events: bool = True,
    critical: bool = False,
    slack: float | None = None,
) -> Any:
    """A stand-in request; ``next_tool`` = the predicted seconds of an announced tool call;
    ``events=False``: its client sends no stall events (``RequestMeta.stall_events``);
    ``critical``: its node is on the app's critical path; ``slack``: its node's slack (s)."""
    meta: dict[str, Any] = {"session_id": session, "run_id": "run", "node": session or "A"}
    if critical:
        meta["graph"] = {"on_critical_path": True}
    elif slack is not None:
        meta["graph"] = {"slack_s": slack}
    if next_tool is not None:
        meta["next_stall"] = {"tool": "search", "predicted_s": next_tool}
    if not events:
        meta["stall_events"] = False
    params = {"tokencake": meta} if session else None
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=hashes,
        num_tokens=num_tokens,
        num_computed_tokens=0,
        num_output_tokens=0,
        kv_transfer_params=params,
    )


def begin(
    stall_id: str = "s1", session: str = "run:A", predicted: float | None = 10.0, *, tool: str = "search"
) -> StallBegin:
    return StallBegin(
        stall_id=stall_id,
        session_id=session,
        run_id="run",
        node="A",
        tool=tool,
        predicted_s=predicted,
        ts=0,
    )


def end(
    stall_id: str = "s1", session: str = "run:A", duration: float = 1.0, *, tool: str = "search"
) -> StallEnd:
    return StallEnd(
        stall_id=stall_id,
        session_id=session,
        run_id="run",
        node="A",
        tool=tool,
        duration_s=duration,
        ts=0,
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, hash_block_size=BS)


def make_side(
    pool: BlockPool, clock: Clock, host_blocks: int = 8, *, s_per_token: float | None = None, **opts: Any
) -> SchedulerSide:
    """``s_per_token`` seeds the prefill profile (what a recompute costs, for continuum / infercept)."""
    # Always "under pressure" unless a test says otherwise.
    options = Options(**{"usage_threshold": 0.0, "prefetch_reserve_frac": 0.0, **opts})
    profile = PrefillProfile(min_tokens=1)
    if s_per_token is not None:
        profile.observe_step(1, s_per_token)
    side = SchedulerSide(
        block_size=BS,
        block_bytes=1000,
        num_host_blocks=host_blocks,
        options=options,
        clock=clock,
        profile=profile,
    )
    side.bind_pool(pool)
    return side


def cache_blocks(pool: BlockPool, hashes: list[bytes]) -> list[Any]:
    """Allocate one block per hash and cache it under that hash (what vLLM's allocate_slots does)."""
    blocks = bp.allocate(pool, len(hashes))
    for i, (b, h) in enumerate(zip(blocks, hashes, strict=True)):
        bp.register(pool, b, h, (i + 1) * BS)
    return blocks


def finish_turn(
    side: SchedulerSide,
    pool: BlockPool,
    hashes: list[bytes],
    req_id: str = "r1",
    *,
    session: str | None = "run:A",
    next_tool: float | None = None,
    admit: bool = False,
    critical: bool = False,
) -> list[Any]:
    """A request of ``session`` computed ``len(hashes)`` full blocks and finished (blocks cached).

    ``admit``: the connector also sees the request admitted (``update_state_after_alloc``).
    """
    req = request(
        req_id, hashes, len(hashes) * BS + 2, session=session, next_tool=next_tool, critical=critical
    )
    side.on_new_request(req)
    if admit:
        side.update_state_after_alloc(req, [], 0)
    blocks = cache_blocks(pool, hashes)
    req.num_computed_tokens = len(hashes) * BS + 1
    side.request_finished(req)
    bp.release(pool, blocks)  # vLLM frees the request's blocks right after the hook
    return blocks


def admit(side: SchedulerSide, pool: BlockPool, req: Any, hit: list[bytes]) -> None:
    """vLLM admits ``req`` with ``hit`` found in the device prefix cache, runs it and frees it."""
    blocks = [bp.cached_block(pool, h) for h in hit]
    assert all(b is not None for b in blocks)
    bp.pin(pool, blocks)  # allocate_slots takes a reference on every hit block
    side.update_state_after_alloc(req, [], 0)
    bp.release(pool, blocks)


def take_over(side: SchedulerSide) -> None:
    """What TokenCake's scheduler (``scheduler.py``) sets when it takes over admission."""
    side.critical_last = True
    side.enable_admission_control()


def ask(side: SchedulerSide, req: Any, hit: int = 0) -> int | None:
    """What vLLM's admission loop asks about ``req`` (``hit``: its device prefix hit, tokens):
    with TokenCake's scheduler ``admit`` first (False: vLLM skips it, shown as None), then the
    connector's ``get_num_new_matched_tokens``."""
    if side.admission_control and not side.admit(req, side.steps.running):
        return None
    return side.get_num_new_matched_tokens(req, hit)


def answer(side: SchedulerSide, meta: TokenCakeMetadata, ok: bool = True) -> None:
    side.on_worker_meta(TokenCakeWorkerMeta({j.job_id: JobResult(ok, 0.001, 0) for j in meta.jobs}))


def put_on_host(side: SchedulerSide, hashes: list[bytes]) -> None:
    """Host copies of ``hashes``, committed and unowned (as an earlier offload leaves them)."""
    for h in hashes:
        (slot,) = side.host.allocate(1, "test")
        side.host.commit(h, slot)


def inversions(side: SchedulerSide) -> tuple[int, ...]:
    """Critical inversions and blocks evicted, then those of them not safe on host."""
    names = ("inversions", "blocks_evicted", "inversions_unsaved", "blocks_evicted_unsaved")
    return tuple(side.stats.counter(f"spatial.critical_{n}") for n in names)


def evict_all(pool: BlockPool) -> None:
    bp.release(pool, bp.allocate(pool, bp.num_free(pool)))


def pinned(pool: BlockPool) -> list[Any]:
    return [b for b in pool.blocks[1:] if b.ref_cnt]


def assert_no_pins(pool: BlockPool) -> None:
    assert not pinned(pool), pinned(pool)


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


def offloaded_then_evicted(side: SchedulerSide, pool: BlockPool, hashes: list[bytes]) -> None:
    """Session A's turn finished, its stall offloaded the chain, and other traffic evicted it."""
    finish_turn(side, pool, hashes)
    side.handle_event(begin())
    answer(side, side.build_meta())
    evict_all(pool)


def test_demand_load_counts_host_hits_past_device_prefix(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("d", 4)
    offloaded_then_evicted(side, pool, hashes)
    side.handle_event(end())
    side.build_meta()
    # Next turn: 4 old blocks + 1 new block + 2 tokens; device has nothing, host has 4 blocks.
    req = request("r2", [*hashes, *chain("new", 1)], 5 * BS + 2)
    side.on_new_request(req)
    assert side.stats.counter("events.inferred_end") == 0  # its end was delivered
    assert ask(side, req, 0) == 4 * BS
    # With one block already on device, only the next 3 come from the host.
    assert ask(side, req, BS) == 3 * BS
    ask(side, req, 0)
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
    # Returned with the response: where this request's prompt KV came from.
    req.num_computed_tokens = 5 * BS + 2
    assert side.request_finished(req) == {
        "device_tokens": 0,
        "prefetched_tokens": 0,
        "copied_tokens": 0,
        "host_tokens": 4 * BS,
        "prompt_tokens": 5 * BS + 2,
        "admissions": 1,
        "failed_copy_tokens": 0,
        "failed_load_tokens": 0,
    }


def b_matches_the_shared_prefix_on_host(
    side: SchedulerSide, pool: BlockPool, shared: list[bytes], own: list[bytes], admitted: int
) -> tuple[Any, list[Any]]:
    """``shared`` saved on host; request B of session B on ``shared + own`` finds it there and
    vLLM allocates (and hashes) ``admitted`` blocks from block 0. Returns B and those blocks."""
    put_on_host(side, shared)
    req = request("rb", [*shared, *own], (len(shared) + len(own)) * BS + 2, session="run:B")
    side.on_new_request(req)
    assert ask(side, req, 0) == len(shared) * BS
    return req, cache_blocks(pool, [*shared, *own][:admitted])  # allocate_slots hashes them this step


def test_blocks_a_failed_load_left_leave_the_prefix_cache(pool: BlockPool, clock: Clock) -> None:
    """vLLM's recompute policy keeps the hashes of blocks whose load failed — and of the blocks the
    same step computed from them — trusting their request to recompute them at once. If it is
    preempted first, any request with that prefix would hit them (its own re-admission too), and
    a save would commit them to the host for everyone. The connector takes them out of the prefix
    cache: the next request on that prefix computes its own blocks, and a save copies those."""
    side = make_side(pool, clock, prefetch=False)
    shared, own = chain("p", 3), chain("b", 1)
    req, blocks = b_matches_the_shared_prefix_on_host(side, pool, shared, own, admitted=4)
    side.update_state_after_alloc(req, [b.block_id for b in blocks], 3 * BS)
    (load,) = side.build_meta().jobs
    answer(side, TokenCakeMetadata([load]), ok=False)  # the load failed: vLLM will recompute
    assert all(side.host.lookup(h) is None for h in shared)
    assert all(bp.cached_block(pool, h) is None for h in [*shared, *own])
    assert all(b.block_hash is None and b.ref_cnt == 1 for b in blocks)  # B still holds them
    assert side.stats.counter("demand_load.uncached_blocks") == 4
    # B is preempted before it recomputed: vLLM frees its blocks, and nothing can hit them.
    side.observe_step(0, preempted={"rb"})
    bp.release(pool, blocks)
    assert all(bp.cached_block(pool, h) is None for h in shared)
    # Session A runs a turn on the same prefix: computed afresh, then saved from those blocks.
    fresh = finish_turn(side, pool, shared, req_id="ra", session="run:A")
    side.handle_event(begin(session="run:A"))
    (offload,) = side.build_meta().jobs
    assert offload.kind == "offload" and offload.device_blocks == [b.block_id for b in fresh]
    answer(side, TokenCakeMetadata([offload]))
    assert all(side.host.lookup(h) is not None for h in shared)
    assert side.copies.suspect == {}
    assert_no_pins(pool)


def load_and_stall_on_the_same_chain(
    side: SchedulerSide, pool: BlockPool, shared: list[bytes], own: list[bytes], admitted: int
) -> tuple[Any, list[Any], Any, Any]:
    """Session A's last turn ran on ``shared + own`` (evicted since); B demand-loads ``shared``
    (``b_matches_the_shared_prefix_on_host``) and A's tool call begins the same step.
    Returns B, its blocks, and the step's load and offload jobs."""
    finish_turn(side, pool, [*shared, *own], req_id="ra", session="run:A")
    evict_all(pool)
    req, blocks = b_matches_the_shared_prefix_on_host(side, pool, shared, own, admitted)
    side.update_state_after_alloc(req, [b.block_id for b in blocks], len(shared) * BS)
    side.handle_event(begin(session="run:A"))
    jobs = {j.kind: j for j in side.build_meta().jobs}
    return req, blocks, jobs["load"], jobs.get("offload")


@pytest.mark.parametrize("offload_reported_first", [False, True])
def test_a_save_computed_from_a_failed_load_is_not_committed(
    pool: BlockPool, clock: Clock, offload_reported_first: bool
) -> None:
    """B's step loads the shared prefix and computes the next block from it; A's save of that
    block, planned the same step, copies it after the forward. When the load is reported
    failed, the block holds KV computed from bad KV under a valid hash: the save, confirmed in
    the same report (in either order), must not be committed — it would be served to every
    request with that prefix."""
    side = make_side(pool, clock, prefetch=False)
    shared, own = chain("p", 3), chain("b", 1)
    req, blocks, load, offload = load_and_stall_on_the_same_chain(side, pool, shared, own, admitted=4)
    assert offload is not None and offload.device_blocks == [blocks[3].block_id]
    results = {load.job_id: JobResult(False, 0.001, 0), offload.job_id: JobResult(True, 0.001, 0)}
    if offload_reported_first:
        results = dict(reversed(results.items()))
    side.on_worker_meta(TokenCakeWorkerMeta(results))
    assert side.host.lookup(own[0]) is None
    assert side.stats.counter("offload.suspect_dropped") == 1
    req.num_computed_tokens = 4 * BS + 2
    side.request_finished(req)
    bp.release(pool, blocks)
    assert_no_pins(pool)


def test_one_ranks_failed_load_is_acted_on_before_the_other_ranks_report(
    pool: BlockPool, clock: Clock
) -> None:
    """Tensor parallel: rank 1 reports B's load failed, rank 0 has not reported it yet; A's save
    of the block B computed from it is confirmed by both ranks in the same report. The failure
    acts at once — the blocks leave the prefix cache, the host copies are dropped, the save is
    not committed — while the load's pins wait for rank 0 (it may still be copying)."""
    side = make_side(pool, clock, prefetch=False)
    side.num_workers = 2
    shared, own = chain("p", 3), chain("b", 1)
    req, blocks, load, offload = load_and_stall_on_the_same_chain(side, pool, shared, own, admitted=4)
    assert offload is not None
    rank1 = {load.job_id: JobResult(False, 0.001, 0), offload.job_id: JobResult(True, 0.001, 0, workers=2)}
    side.on_worker_meta(TokenCakeWorkerMeta(rank1))
    assert side.host.lookup(own[0]) is None and side.stats.counter("offload.suspect_dropped") == 1
    assert all(side.host.lookup(h) is None for h in shared)
    assert all(bp.cached_block(pool, h) is None for h in [*shared, *own])
    assert [j.kind for j in side.copies.jobs.values()] == ["load"]  # its host pins wait for rank 0
    assert side.host.owned_by(f"job:{load.job_id}") == sorted(load.host_slots)
    side.on_worker_meta(TokenCakeWorkerMeta({load.job_id: JobResult(True, 0.001, 0)}))
    assert not side.copies.jobs and side.stats.counter("load.failed") == 1
    assert side.host.owned_by(f"job:{load.job_id}") == []
    assert side.stats.counter("demand_load.uncached_blocks") == 4  # marked once
    req.num_computed_tokens = 4 * BS + 2
    side.request_finished(req)
    bp.release(pool, blocks)
    assert_no_pins(pool)


def test_a_ranks_invalid_block_ids_fail_its_load_before_its_result_arrives(
    pool: BlockPool, clock: Clock
) -> None:
    """A rank's failed load can reach the scheduler as ``invalid_block_ids`` before any rank's
    result for the job (vLLM merges the ranks' ids): the load fails at once. Ids of no load in
    flight change nothing."""
    side = make_side(pool, clock, prefetch=False)
    side.num_workers = 2
    shared, own = chain("p", 3), chain("b", 1)
    req, blocks = b_matches_the_shared_prefix_on_host(side, pool, shared, own, admitted=4)
    side.update_state_after_alloc(req, [b.block_id for b in blocks], 3 * BS)
    (load,) = side.build_meta().jobs
    others = cache_blocks(pool, chain("q", 1))
    side.on_worker_meta(None, {others[0].block_id})
    assert side.host.lookup(shared[0]) is not None and bp.cached_block(pool, shared[0]) is not None
    side.on_worker_meta(None, {load.device_blocks[1]})
    assert all(side.host.lookup(h) is None for h in shared)
    assert all(bp.cached_block(pool, h) is None for h in [*shared, *own])
    assert bp.cached_block(pool, chain("q", 1)[0]) is others[0]
    both = TokenCakeWorkerMeta({load.job_id: JobResult(True, 0.001, 0, workers=2)})
    side.on_worker_meta(both, {load.device_blocks[1]})  # the ranks' results, a step later
    assert not side.copies.jobs and side.stats.counter("load.failed") == 1
    assert side.stats.counter("demand_load.uncached_blocks") == 4
    req.num_computed_tokens = 4 * BS + 2
    side.request_finished(req)
    bp.release(pool, [*blocks, *others])
    assert_no_pins(pool)


def test_a_later_chunk_computed_before_a_load_failure_was_known_is_not_committed(
    pool: BlockPool, clock: Clock
) -> None:
    """With async scheduling the next prefill chunk is scheduled (its blocks hashed) before the
    failed load's report arrives. Those blocks were not allocated at admission, so the
    request's own block hashes find them: a save of them is not committed either."""
    side = make_side(pool, clock, prefetch=False)
    shared, own = chain("p", 3), chain("b", 2)
    req, blocks, load, offload = load_and_stall_on_the_same_chain(side, pool, shared, own, admitted=4)
    assert offload is not None
    chunk = cache_blocks(pool, own[1:])  # the next chunk, scheduled before the load's report
    side.handle_event(end(session="run:A"))
    side.handle_event(begin("s2", session="run:A"))
    second = [j for j in side.build_meta().jobs if j.kind == "offload"]
    assert [j.device_blocks for j in second] == [[chunk[0].block_id]]
    # The first step's report (the load failed), then the next step's (its save copied fine).
    results = {load.job_id: JobResult(False, 0.001, 0), offload.job_id: JobResult(True, 0.001, 0)}
    side.on_worker_meta(TokenCakeWorkerMeta(results))
    answer(side, TokenCakeMetadata(second))
    assert side.host.lookup(own[0]) is None and side.host.lookup(own[1]) is None
    req.num_computed_tokens = 5 * BS + 2
    side.request_finished(req)
    assert side.copies.suspect == {}
    bp.release(pool, [*blocks, *chunk])
    assert_no_pins(pool)


def test_a_hit_on_a_load_in_flight_waits_only_until_the_bound_then_leaves_the_prefix_cache(
    pool: BlockPool, clock: Clock
) -> None:
    """A request whose device prefix hit includes blocks of a demand load not confirmed yet waits
    ("not yet"), each pass counted; a load unconfirmed ``prefetch_wait_s`` after it was issued is
    not waited for longer: its blocks leave the prefix cache (the loading request keeps them),
    so the request computes or loads the prefix itself — it is never served KV the load may
    not have written. A hit that does not reach the load's blocks never waits."""
    side = make_side(pool, clock, prefetch=False)
    shared, own = chain("p", 3), chain("b", 1)
    req, blocks = b_matches_the_shared_prefix_on_host(side, pool, shared, own, admitted=4)
    side.update_state_after_alloc(req, [b.block_id for b in blocks], 3 * BS)
    (load,) = side.build_meta().jobs
    other = request("rc", [*shared, *chain("c", 1)], 4 * BS + 2, session=None)
    side.on_new_request(other)
    assert ask(side, other, 3 * BS) is None
    clock.t += side.opts.prefetch_wait_s / 2
    assert ask(side, other, 3 * BS) is None
    assert side.stats.counter("admission.held_back.load_in_flight") == 2
    unrelated = request("rd", chain("d", 2), 2 * BS + 2, session=None)
    side.on_new_request(unrelated)
    assert ask(side, unrelated, 0) == 0
    clock.t += side.opts.prefetch_wait_s
    assert ask(side, other, 3 * BS) is None  # vLLM's lookup of this pass found them still cached
    assert side.stats.counter("admission.past_bound.load_in_flight") == 1
    assert all(bp.cached_block(pool, h) is None for h in shared)
    assert all(b.ref_cnt == 1 for b in blocks) and not side.demand.loading
    assert ask(side, other, 0) == 3 * BS  # no device hit now: its own load of the host copies
    answer(side, TokenCakeMetadata([load]))
    assert not side.copies.jobs and side.stats.counter("admission.held_back.load_in_flight") == 2
    req.num_computed_tokens = 4 * BS + 2
    side.request_finished(req)
    bp.release(pool, blocks)
    assert_no_pins(pool)


def test_a_failed_load_plan_marks_its_blocks_as_a_failed_load_does(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    shared, own = chain("p", 3), chain("b", 1)
    req, blocks = b_matches_the_shared_prefix_on_host(side, pool, shared, own, admitted=4)
    side.fail_load(req, [b.block_id for b in blocks], 3 * BS)
    (job,) = side.build_meta().jobs
    assert job.kind == "load" and job.invalid
    assert set(side.copies.suspect) == {b.block_id for b in blocks}
    assert all(bp.cached_block(pool, h) is None for h in [*shared, *own])
    bp.release(pool, blocks)
    assert_no_pins(pool)


def test_a_failed_admission_reports_its_own_blocks_not_an_earlier_admissions(
    pool: BlockPool, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fail_load`` (the connector's last resort when ``update_state_after_alloc`` raises) marks
    the blocks this admission mapped the external tokens to: a request admitted before from a
    longer device hit (then preempted) must not have that earlier start reused, or the blocks in
    between would be taken as loaded though nothing wrote them."""
    side = make_side(pool, clock, prefetch=False)
    shared, own = chain("p", 3), chain("b", 1)
    req, blocks = b_matches_the_shared_prefix_on_host(side, pool, shared, own, admitted=4)
    side.demand.usa_req, side.demand.usa_first = "rb", 2  # what its earlier admission left

    def broken(_session_id: str) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(side.critical, "unwatch", broken)
    ids = [b.block_id for b in blocks]
    with pytest.raises(RuntimeError):
        side.update_state_after_alloc(req, ids, 3 * BS)
    side.fail_load(req, ids, 3 * BS)
    (job,) = side.build_meta().jobs
    assert job.kind == "load" and job.invalid and job.device_blocks == ids[:3]
    bp.release(pool, blocks)
    assert_no_pins(pool)


def test_provenance_traces_failed_copies(pool: BlockPool, clock: Clock) -> None:
    """A failed offload is reported with the session's next request, a failed load with its own."""
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("f", 3)
    finish_turn(side, pool, hashes)
    side.handle_event(begin())
    answer(side, side.build_meta(), ok=False)  # the offload failed: nothing committed
    assert all(side.host.lookup(h) is None for h in hashes)
    side.handle_event(end())
    side.build_meta()
    req = request("r2", [*hashes, *chain("new", 1)], 4 * BS + 2)
    side.on_new_request(req)
    assert ask(side, req, 0) == 0
    admit(side, pool, req, hashes)
    req.num_computed_tokens = 4 * BS + 2
    prov = side.request_finished(req)
    assert prov is not None and (prov["failed_copy_tokens"], prov["failed_load_tokens"]) == (3 * BS, 0)
    # Reported once: the session's following request starts clean.
    again = request("r3", [*hashes, *chain("new", 1)], 4 * BS + 2)
    side.on_new_request(again)
    admit(side, pool, again, hashes)
    prov = side.request_finished(again)
    assert prov is not None and prov["failed_copy_tokens"] == 0

    # Session B: offloaded, evicted, and its demand load fails (vLLM recomputes those tokens).
    other = chain("g", 3)
    finish_turn(side, pool, other, "b1", session="run:B")
    side.handle_event(begin("s2", session="run:B"))
    answer(side, side.build_meta())
    evict_all(pool)
    side.handle_event(end("s2", session="run:B"))
    side.build_meta()
    req = request("b2", [*other, *chain("next", 1)], 4 * BS + 2, session="run:B")
    side.on_new_request(req)
    assert ask(side, req, 0) == 3 * BS
    allocated = bp.allocate(pool, 5)
    side.update_state_after_alloc(req, [b.block_id for b in allocated], 3 * BS)
    answer(side, side.build_meta(), ok=False)
    bp.release(pool, allocated)
    assert_no_pins(pool)
    req.num_computed_tokens = 4 * BS + 2
    prov = side.request_finished(req)
    assert prov is not None and (prov["host_tokens"], prov["failed_load_tokens"]) == (3 * BS, 3 * BS)


def test_provenance_blames_hits_on_blocks_a_host_copy_wrote(pool: BlockPool, clock: Clock) -> None:
    """Another session's device hit on blocks a load wrote (a shared prefix) counts as copied KV."""
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("shared", 3)
    offloaded_then_evicted(side, pool, hashes)
    req = request("r2", [*hashes, *chain("own", 1)], 4 * BS + 2)
    side.on_new_request(req)
    assert ask(side, req, 0) == 3 * BS
    blocks = bp.allocate(pool, 5)
    side.update_state_after_alloc(req, [b.block_id for b in blocks], 3 * BS)
    answer(side, side.build_meta())
    for i, (b, h) in enumerate(zip(blocks[:3], hashes, strict=True)):
        bp.register(pool, b, h, (i + 1) * BS)  # vLLM caches the loaded blocks under their hashes
    bp.release(pool, blocks)
    other = request("o1", [*hashes, *chain("theirs", 1)], 4 * BS + 2, session="run:B")
    side.on_new_request(other)
    assert ask(side, other, 3 * BS) == 0
    admit(side, pool, other, hashes)
    other.num_computed_tokens = 4 * BS + 2
    prov = side.request_finished(other)
    assert prov is not None
    assert (prov["device_tokens"], prov["copied_tokens"], prov["host_tokens"]) == (3 * BS, 3 * BS, 0)
    # After a prefix-cache reset nothing on device counts as copied any more.
    side.reset_cache()
    assert side.demand.copied == {}


def test_a_policy_without_demand_load_loads_nothing(pool: BlockPool, clock: Clock) -> None:
    """``KVPolicy.demand_load = False`` (the ``stock`` policy): a device miss is not served from host."""
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("d", 4)
    offloaded_then_evicted(side, pool, hashes)
    side.handle_event(end())
    side.build_meta()
    side.policy.demand_load = False
    req = request("r2", [*hashes, *chain("new", 1)], 5 * BS + 2)
    side.on_new_request(req)
    assert ask(side, req, 0) == 0


def test_demand_load_leaves_one_token_to_compute(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("e", 3)
    finish_turn(side, pool, hashes)
    side.handle_event(begin())
    answer(side, side.build_meta())
    # A prompt that is exactly the 3 cached blocks: at most 2 may be loaded (a token must remain).
    req = request("r2", hashes, 3 * BS)
    assert ask(side, req, 0) == 2 * BS


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
    # Held for the session until its request is admitted: the running requests' allocations
    # cannot evict it meanwhile.
    assert sorted(b.block_id for b in pinned(pool)) == sorted(job.device_blocks)
    evict_all(pool)
    assert all(bp.cached_block(pool, h) is not None for h in hashes)
    # The session's next turn hits on device: on time, nothing recomputed.
    side.handle_event(end())
    side.build_meta()
    req = request("r2", [*hashes, *chain("n", 1)], 4 * BS + 1)
    side.on_new_request(req)
    assert ask(side, req, 3 * BS) == 0
    admit(side, pool, req, hashes)
    assert side.stats.counter("prefetch.on_time") == 1
    assert side.stats.counter("readiness.prefetched") == 1
    assert side.stats.counter("hold.released.admitted") == 1
    assert side.stats.counter("next_turn.prefix_tokens_device") == 3 * BS
    assert_no_pins(pool)
    prov = side.request_finished(req)
    assert prov is not None
    assert (prov["device_tokens"], prov["prefetched_tokens"], prov["host_tokens"]) == (3 * BS, 3 * BS, 0)
    assert prov["copied_tokens"] == 3 * BS  # the prefetch's copy wrote those device blocks
    # A request that never got admitted reports nothing.
    lost = request("r3", chain("l", 2), 2 * BS + 1)
    side.on_new_request(lost)
    assert side.request_finished(lost) is None


def test_a_prefetch_does_not_publish_a_host_copy_dropped_while_it_was_copied(
    pool: BlockPool, clock: Clock
) -> None:
    """A failed load of the same host slot drops it meanwhile ("may be bad"); the prefetch copied
    the same bytes, so those blocks stay out of the prefix cache too."""
    side = make_side(pool, clock)
    hashes = _offloaded_and_evicted(side, pool, clock, n=3)
    clock.t += 1.0
    meta = side.build_meta()
    assert [j.kind for j in meta.jobs] == ["prefetch"]
    side.host.drop(hashes[1])
    answer(side, meta)
    assert bp.cached_block(pool, hashes[0]) is not None and bp.cached_block(pool, hashes[1]) is None
    assert side.stats.counter("prefetch.source_dropped") == 1
    side.release_device_holds()
    evict_all(pool)
    assert_no_pins(pool)


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
    assert len(pinned(pool)) == 2  # held for the request that follows the tool's return …
    clock.t += side.opts.keep_after_end_s + 0.1
    side.build_meta()
    assert_no_pins(pool)  # … which never came: let go soon after the tool returned
    assert side.stats.counter("hold.released.ttl") == 1


def _offloaded_and_evicted(side: SchedulerSide, pool: BlockPool, clock: Clock, n: int = 2) -> list[bytes]:
    hashes = chain("h", n)
    finish_turn(side, pool, hashes)
    side.handle_event(begin(predicted=1.0))
    answer(side, side.build_meta())
    evict_all(pool)
    return hashes


def test_a_stall_whose_end_was_lost_ends_when_its_session_sends_the_next_request(
    pool: BlockPool, clock: Clock
) -> None:
    # The stall_end never arrived (a reporter in cooldown, a dropped connection). The session's
    # next request says the tool is over: the stall is accounted against it and its host pins go,
    # instead of lasting until the stall expires (up to an hour for a plan marked waiting).
    side = make_side(pool, clock, prefetch=False)
    hashes = _offloaded_and_evicted(side, pool, clock)
    assert len(side.host.owned_by(stall_owner("s1"))) == 2
    clock.t += 3.0
    nxt = request("r2", [*hashes, *chain("n", 1)], 3 * BS + 1)
    side.on_new_request(nxt)
    assert side.stats.counter("events.inferred_end") == 1
    assert ask(side, nxt, 0) == 2 * BS  # a demand load of the saved chain
    allocated = bp.allocate(pool, 3)
    side.update_state_after_alloc(nxt, [b.block_id for b in allocated], 2 * BS)
    (load,) = side.build_meta().jobs
    answer(side, TokenCakeMetadata([load]))
    assert side.stats.counter("next_turn.requests") == 1
    assert side.stats.counter("next_turn.prefix_tokens_recomputed") == 0
    assert side.host.owned_by(stall_owner("s1")) == []
    assert side.host.num_reclaimable == 2
    # The real end, late, changes nothing.
    assert side.handle_event(end(duration=3.0)).status == "duplicate"
    bp.release(pool, allocated)


def test_a_delivered_end_still_queued_when_the_request_arrives_is_not_inferred(
    pool: BlockPool, clock: Clock
) -> None:
    # The usual order: the SDK's end is recorded, then the request comes before any engine step
    # drained the end. That is a real end, not a lost one.
    side = make_side(pool, clock, prefetch=False)
    hashes = _offloaded_and_evicted(side, pool, clock)
    side.handle_event(end(duration=3.0))
    nxt = request("r2", [*hashes, *chain("n", 1)], 3 * BS + 1)
    side.on_new_request(nxt)
    assert side.stats.counter("events.inferred_end") == 0
    assert ask(side, nxt, 0) == 2 * BS


def test_an_offloaded_stall_whose_prefetch_failed_expires_while_its_tool_still_runs(
    pool: BlockPool, clock: Clock
) -> None:
    # Its plan is cancelled by the failure, so the planner no longer expires it: without an end
    # the stall (and its host pins) must still expire at the usual deadline, not after an hour.
    side = make_side(pool, clock)
    _offloaded_and_evicted(side, pool, clock)
    clock.t += 0.5
    (job,) = side.build_meta().jobs
    assert job.kind == "prefetch"
    answer(side, TokenCakeMetadata([job]), ok=False)
    side.build_meta()
    assert side.host.owned_by(stall_owner("s1"))
    clock.t += side.opts.expiry_min_s + 1.0
    side.build_meta()
    assert side.host.owned_by(stall_owner("s1")) == []
    assert side.stats.counter("stalls.expired.no_stall_end") == 1


def test_prefetch_leaves_the_queue_the_blocks_it_needs(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    _offloaded_and_evicted(side, pool, clock)
    # 15 usable blocks; a queued request that needs all of them: the prefetch waits.
    side.on_new_request(request("big", chain("w", 1), 15 * BS, session=None))
    clock.t += 2.0
    assert side.build_meta().jobs == []
    assert side.stats.counter("prefetch.deferred.waiting") == 1
    # Once it is admitted, the prefetch goes even though other requests keep arriving.
    side.update_state_after_alloc(request("big", chain("w", 1), 15 * BS, session=None), [], 0)
    side.on_new_request(request("small", chain("s", 1), 9, session=None))
    (job,) = side.build_meta().jobs
    assert job.kind == "prefetch" and len(job.device_blocks) == 2


def test_prefetch_brings_back_the_chain_head_when_room_is_short(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    hashes = _offloaded_and_evicted(side, pool, clock, n=3)
    side.on_new_request(request("q", chain("w", 1), 13 * BS, session=None))  # leaves 2 of 15
    clock.t += 2.0
    (job,) = side.build_meta().jobs
    assert job.kind == "prefetch" and len(job.device_blocks) == 2
    answer(side, TokenCakeMetadata([job]))
    assert bp.cached_block(pool, hashes[0]) is not None and bp.cached_block(pool, hashes[2]) is None
    assert side.stats.counter("prefetch.partial") == 1
    assert len(pinned(pool)) == 2 and side.stats.counter("hold.blocks") == 2


def _partly_prefetched(side: SchedulerSide, pool: BlockPool, clock: Clock) -> tuple[list[bytes], Any]:
    """A 3-block chain of which a queued request leaves room for the head (2 blocks) only."""
    hashes = _offloaded_and_evicted(side, pool, clock, n=3)
    queued = request("q", chain("w", 1), 13 * BS, session=None)
    side.on_new_request(queued)  # leaves 2 of 15
    clock.t += 2.0
    (job,) = side.build_meta().jobs
    answer(side, TokenCakeMetadata([job]))
    assert bp.cached_block(pool, hashes[2]) is None
    return hashes, queued


def test_a_partial_prefetch_is_topped_up_once_room_frees(pool: BlockPool, clock: Clock) -> None:
    # The head alone leaves the returning request a demand load of the rest: once the queue's
    # request is admitted the budget has room again, and the rest follows while the tool runs.
    side = make_side(pool, clock)
    hashes, queued = _partly_prefetched(side, pool, clock)
    assert side.build_meta().jobs == []  # still no room: nothing taken from the queue
    assert side.stats.counter("prefetch.deferred.waiting") == 0
    side.update_state_after_alloc(queued, [], 0)
    (job,) = side.build_meta().jobs
    assert job.kind == "prefetch" and len(job.device_blocks) == 1
    answer(side, TokenCakeMetadata([job]))
    assert all(bp.cached_block(pool, h) is not None for h in hashes)
    assert len(pinned(pool)) == 3  # the hold covers the whole chain now
    assert side.stats.counter("prefetch.topups") == 1
    assert side.build_meta().jobs == []  # nothing more to top up
    side.handle_event(end(duration=2.0))
    nxt = request("r2", [*hashes, *chain("n", 1)], 4 * BS + 1)
    side.on_new_request(nxt)
    assert ask(side, nxt, 3 * BS) == 0  # a whole device hit
    side.update_state_after_alloc(nxt, [], 0)
    assert side.stats.counter("readiness.prefetched") == 1


def test_no_top_up_once_the_request_has_come(pool: BlockPool, clock: Clock) -> None:
    # The request's own demand load brings the rest: a top-up now would copy the same blocks.
    side = make_side(pool, clock)
    hashes, queued = _partly_prefetched(side, pool, clock)
    side.handle_event(end(duration=2.0))
    nxt = request("r2", [*hashes, *chain("n", 1)], 4 * BS + 1)
    side.on_new_request(nxt)
    side.update_state_after_alloc(queued, [], 0)
    assert side.build_meta().jobs == []
    assert side.stats.counter("prefetch.topups") == 0
    # Admitted: a device hit on the head, a demand load of the rest; the upload served its head.
    assert ask(side, nxt, 2 * BS) == BS
    side.update_state_after_alloc(nxt, [b.block_id for b in bp.allocate(pool, 3)], BS)
    assert side.stats.counter("prefetch.head_only") == 1
    assert side.stats.counter("prefetch.wasted") == 0


def test_request_waits_for_its_prefetch_instead_of_loading_twice(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    hashes = _offloaded_and_evicted(side, pool, clock)
    clock.t += 2.0
    (job,) = side.build_meta().jobs
    assert job.kind == "prefetch"
    side.handle_event(end(duration=2.0))
    req = request("r2", [*hashes, *chain("n", 1)], 3 * BS + 1)
    side.on_new_request(req)
    assert ask(side, req, 0) is None  # vLLM asks again next step
    answer(side, TokenCakeMetadata([job]))
    assert ask(side, req, 2 * BS) == 0  # now a device hit
    side.update_state_after_alloc(req, [], 0)
    assert side.stats.counter("readiness.eligible") == 1
    assert side.stats.counter("readiness.loading") == 1
    assert side.stats.counter("next_turn.prefix_tokens_recomputed") == 0
    assert_no_pins(pool)


def test_an_offloaded_stall_whose_prefetch_failed_lets_its_host_pins_go(
    pool: BlockPool, clock: Clock
) -> None:
    # The failed prefetch cancels the plan, so the planner never expires the stall; if its session
    # sends no further request, its host copies must still be unpinned after the end (not held
    # until a request that never comes).
    side = make_side(pool, clock)
    hashes = _offloaded_and_evicted(side, pool, clock)
    assert len(side.host.owned_by(stall_owner("s1"))) == len(hashes)
    clock.t += 2.0
    (job,) = side.build_meta().jobs
    assert job.kind == "prefetch"
    answer(side, TokenCakeMetadata([job]), ok=False)
    side.handle_event(end(duration=2.0))
    side.build_meta()
    assert side.host.owned_by(stall_owner("s1"))  # ended just now: the session may still come back
    clock.t += side.planner.unused_after_s + side.opts.end_grace_s + 1.0
    waiting = request("r2", [*hashes, *chain("n", 1)], 3 * BS + 1)
    side.on_new_request(waiting)
    side.build_meta()
    assert side.host.owned_by(stall_owner("s1"))  # its request is queued: the copies stay pinned for its load
    side.request_finished(waiting)  # … it was aborted instead
    side.build_meta()
    assert side.host.owned_by(stall_owner("s1")) == []
    assert [side.host.lookup(h) is not None for h in hashes] == [True, True]  # cached, reclaimable
    assert side.host.available == side.host.num_blocks


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


def test_unconfirmed_jobs_time_out_and_release_on_the_late_report(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("t", 2)
    finish_turn(side, pool, hashes)
    side.handle_event(begin())
    meta = side.build_meta()
    assert side.has_pending_work()
    clock.t += 120
    side.build_meta()
    assert side.stats.counter("jobs.timed_out") == 1 and not side.has_pending_work()
    assert any(b.ref_cnt for b in pool.blocks[1:])  # pinned until the workers answer
    # An idle engine is woken now and then so the worker can poll for the late report.
    assert side.next_wake_at() == clock.t + ABANDONED_POLL_S
    clock.t += ABANDONED_POLL_S
    assert side.has_pending_work()
    side.build_meta()
    assert not side.has_pending_work() and side.next_wake_at() == clock.t + ABANDONED_POLL_S
    answer(side, meta)  # the late report: released, nothing committed
    assert side.stats.counter("jobs.late_reports") == 1 and not side.copies.jobs
    assert all(side.host.lookup(h) is None for h in hashes)
    assert_no_pins(pool)
    side.build_meta()
    assert side.next_wake_at() is None and not side.has_pending_work()  # nothing left to poll for


def test_workers_that_cannot_copy_turn_the_policy_off(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    side.on_worker_meta(TokenCakeWorkerMeta({}, disabled="kernel block size 8 != 16"))
    assert side.copies.copies_disabled and side.stats.snapshot()["gauges"]["worker.copies_disabled"] == 1
    finish_turn(side, pool, chain("z", 2))
    side.handle_event(begin())
    assert side.build_meta().jobs == []  # nothing planned that would only fail


def test_a_multi_worker_job_completes_once_every_worker_reported(pool: BlockPool, clock: Clock) -> None:
    side = SchedulerSide(
        block_size=BS,
        block_bytes=1000,
        num_host_blocks=8,
        num_workers=2,
        options=Options(usage_threshold=0.0, prefetch_reserve_frac=0.0),
        clock=clock,
    )
    side.bind_pool(pool)
    hashes = chain("w", 2)
    finish_turn(side, pool, hashes)
    side.handle_event(begin())
    (job,) = side.build_meta().jobs
    side.on_worker_meta(TokenCakeWorkerMeta({job.job_id: JobResult(False, 0.001, 0)}))  # rank 0 failed
    assert side.copies.jobs  # rank 1 may still be copying: nothing released yet
    side.on_worker_meta(TokenCakeWorkerMeta({job.job_id: JobResult(True, 0.001, 0)}))
    assert not side.copies.jobs and side.stats.counter("offload.failed") == 1
    assert all(side.host.lookup(h) is None for h in hashes)
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


def test_host_copies_stay_pinned_while_the_next_request_waits(pool: BlockPool, clock: Clock) -> None:
    """A queue longer than end_grace_s must not free the copies the queued request loads next
    (at 1,000 agents in the simulator that freed most copies and each turn recomputed)."""
    side = make_side(pool, clock, prefetch=False, end_grace_s=5.0)
    hashes = chain("q", 3)
    finish_turn(side, pool, hashes)
    side.handle_event(begin(predicted=1.0))
    answer(side, side.build_meta())
    side.handle_event(end(duration=1.0))
    nxt = request("r2", hashes, 3 * BS + 5, next_tool=None)
    side.on_new_request(nxt)  # queued behind others
    clock.t += 100.0
    side.build_meta()
    assert side.host.num_reclaimable == 0  # still pinned for the waiting request
    assert ask(side, nxt, 0) == 3 * BS  # loads from host when admitted
    # Aborted while queued: the grace applies from then on.
    side.request_finished(nxt)
    clock.t += 5.0
    side.build_meta()
    assert side.host.num_reclaimable == 3


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
    assert ask(side, req, 0) == 0
    req.num_computed_tokens = 9
    side.request_finished(req)
    assert side.sessions.stats()["sessions"] == 0


# ------------------------------------------------------------------ issue-9 regressions


def test_offload_of_blocks_hashed_this_step_commits_the_forward_kv(pool: BlockPool, clock: Clock) -> None:
    """Stale KV: A's chain was evicted; B re-allocates the same prefix this step (hashed before its
    forward) while A's stall begins. The offload must copy B's blocks after B's forward."""
    torch = pytest.importorskip("torch")
    from tokencake.serving.vllm.worker import WorkerSide

    side = make_side(pool, clock, prefetch=False)
    hashes = chain("shared", 3)
    finish_turn(side, pool, hashes)
    evict_all(pool)  # A's blocks are gone, nothing on host (the gate never ran)
    caches = {"l0": torch.zeros((NUM_BLOCKS, 2, BS, 4), dtype=torch.bfloat16)}
    worker = WorkerSide(NUM_BLOCKS, 8)
    worker.register_kv_caches(caches)
    # Step N: vLLM allocates B's blocks and caches their hashes (allocate_slots → cache_blocks) …
    b_blocks = cache_blocks(pool, hashes)
    # … and A's stall_begin is handled in the same step's build_connector_meta.
    side.handle_event(begin())
    meta = side.build_meta()
    (job,) = meta.jobs
    assert job.kind == "offload" and job.device_blocks == [b.block_id for b in b_blocks]
    worker.start_jobs(meta)  # start_load_kv (before the forward in a step with sync loads)
    ids = [b.block_id for b in b_blocks]
    computed = torch.arange(3 * 2 * BS * 4, dtype=torch.float32).reshape(3, 2, BS, 4).to(torch.bfloat16)
    caches["l0"][ids] = computed  # the forward writes B's KV
    worker.start_saves()  # wait_for_save
    side.on_worker_meta(worker.take_results())
    slots = [side.host.lookup(h) for h in hashes]
    assert None not in slots
    assert torch.equal(worker.copier.host_tensors[0][slots], computed)
    bp.release(pool, b_blocks)
    assert_no_pins(pool)


def empty_free_blocks(pool: BlockPool) -> int:
    """Free blocks with no hash: vLLM keeps them at the front of its free queue."""
    return sum(b.block_hash is None for b in pool.free_block_queue.get_all_free_blocks())


def test_offloaded_session_is_evicted_first_latest_return_first(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    a = chain("a", 2)
    finish_turn(side, pool, a, req_id="ra")
    b = chain("b", 2)
    finish_turn(side, pool, b, req_id="rb", session="run:B")
    c = chain("c", 2)  # an active session's cached prefix, idle for a moment
    bp.release(pool, cache_blocks(pool, c))
    side.handle_event(begin("sa", "run:A", predicted=5.0))
    side.handle_event(begin("sb", "run:B", predicted=50.0))
    answer(side, side.build_meta())
    rank = bp.eviction_rank(pool)
    pos = {
        name: [rank[bp.cached_block(pool, h).block_id] for h in hs]
        for name, hs in (("a", a), ("b", b), ("c", c))
    }
    # Empty blocks (no hash) cost nothing to take: they stay first in line. Then B, which returns
    # last (tail before head), then A's; the active prefix C last.
    e = empty_free_blocks(pool)
    assert e > 0
    assert pos["b"] == [e + 1, e] and pos["a"] == [e + 3, e + 2]
    assert min(pos["c"]) > e + 3
    assert side.stats.counter("evict_order.demoted_blocks") >= 4
    # A's tool returns: its blocks go back to the safe end, B stays first in line.
    side.handle_event(end("sa", "run:A"))
    side.build_meta()
    rank = bp.eviction_rank(pool)
    assert rank[bp.cached_block(pool, b[1]).block_id] == empty_free_blocks(pool)
    assert min(rank[bp.cached_block(pool, h).block_id] for h in a) > max(
        rank[bp.cached_block(pool, h).block_id] for h in c
    )
    assert_no_pins(pool)


def _finish_sharing(
    side: SchedulerSide, pool: BlockPool, shared: list[bytes], tag: str, session: str
) -> list[bytes]:
    """A request of ``session`` hit ``shared`` on device, computed its own 2 blocks and finished."""
    hashes = shared + chain(tag, 2)
    req = request(f"r{tag}", hashes, len(hashes) * BS + 2, session=session)
    side.on_new_request(req)
    hits = [bp.cached_block(pool, h) for h in shared]
    bp.pin(pool, hits)
    own = bp.allocate(pool, 2)
    for i, (blk, h) in enumerate(zip(own, hashes[len(shared) :], strict=True)):
        bp.register(pool, blk, h, (len(shared) + i + 1) * BS)
    req.num_computed_tokens = len(hashes) * BS + 1
    side.request_finished(req)
    bp.release(pool, [*reversed(own), *reversed(hits)])
    return hashes


def test_demoting_a_session_leaves_the_prompt_it_shares_with_another_stalled_one(
    pool: BlockPool, clock: Clock
) -> None:
    """A and B share a system prompt; both are away on a tool call, only A's chain is offloaded.
    A's own blocks go first in line; the shared prompt stays where LRU put it (B still needs it
    on device, and losing it would cost B its whole device prefix hit)."""
    side = make_side(pool, clock, prefetch=False, host_blocks=16)
    shared = chain("sys", 2)
    a = shared + chain("a", 2)
    finish_turn(side, pool, a, req_id="ra", session="run:A")
    b = _finish_sharing(side, pool, shared, "b", "run:B")
    side.handle_event(begin("sb", "run:B", predicted=0.001))  # too short to offload: stays
    answer(side, side.build_meta())
    side.handle_event(begin("sa", "run:A", predicted=50.0))
    answer(side, side.build_meta())
    assert side.stats.counter("stalls.decision.offload") == 1
    rank = bp.eviction_rank(pool)
    e = empty_free_blocks(pool)
    pos = {h: rank[bp.cached_block(pool, h).block_id] for h in a + b}
    assert sorted(pos[h] for h in a[2:]) == [e, e + 1]  # A's own blocks: first in line
    assert min(pos[h] for h in shared) > max(pos[h] for h in b[2:])  # the prompt: LRU's place
    assert_no_pins(pool)


def test_a_prompt_shared_by_demoted_sessions_goes_with_the_one_back_first(
    pool: BlockPool, clock: Clock
) -> None:
    """Both chains offloaded: the shared prompt takes the place of the session that returns first
    (the one evicted last), whichever was demoted first."""
    side = make_side(pool, clock, prefetch=False, host_blocks=16)
    shared = chain("sys", 2)
    a = shared + chain("a", 2)
    finish_turn(side, pool, a, req_id="ra", session="run:A")
    b = _finish_sharing(side, pool, shared, "b", "run:B")
    side.handle_event(begin("sa", "run:A", predicted=50.0))  # back last
    answer(side, side.build_meta())
    side.handle_event(begin("sb", "run:B", predicted=10.0))  # back first
    answer(side, side.build_meta())
    assert side.stats.counter("stalls.decision.offload") == 2
    rank = bp.eviction_rank(pool)
    e = empty_free_blocks(pool)
    pos = {h: rank[bp.cached_block(pool, h).block_id] for h in a + b}
    # A (back last) first in line, then B's own blocks, then the prompt it shares with B.
    assert sorted(pos[h] for h in a[2:]) == [e, e + 1]
    assert sorted(pos[h] for h in b[2:]) == [e + 2, e + 3]
    assert sorted(pos[h] for h in shared) == [e + 4, e + 5]
    assert_no_pins(pool)


def test_demotion_order_is_by_return_whatever_order_the_copies_finish(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False, host_blocks=12)
    chains = {name: chain(name, 2) for name in ("x", "y", "z")}
    returns = {"x": 30.0, "y": 10.0, "z": 20.0}
    for name, hashes in chains.items():
        finish_turn(side, pool, hashes, req_id=f"r{name}", session=f"run:{name}")
    for name in ("x", "y", "z"):  # x (returns last) is confirmed first, then y, then z (middle)
        side.handle_event(begin(f"s{name}", f"run:{name}", predicted=returns[name]))
        answer(side, side.build_meta())
    rank = bp.eviction_rank(pool)
    first = {name: min(rank[bp.cached_block(pool, h).block_id] for h in hs) for name, hs in chains.items()}
    assert first["x"] < first["z"] < first["y"]  # latest return first in line, whatever the order
    assert_no_pins(pool)


@pytest.mark.parametrize("critical_last", [False, True])
def test_spatial_scheduler_demotes_critical_path_sessions_last(
    pool: BlockPool, clock: Clock, critical_last: bool
) -> None:
    side = make_side(pool, clock, prefetch=False, host_blocks=12)
    if critical_last:  # what SpatialScheduler sets when it takes over admission
        take_over(side)
    chains = {name: chain(name, 2) for name in ("crit", "late", "early")}
    returns = {"crit": 40.0, "late": 30.0, "early": 10.0}
    for name, hashes in chains.items():
        finish_turn(side, pool, hashes, req_id=f"r{name}", session=f"run:{name}", critical=name == "crit")
    for name in ("early", "late", "crit"):  # the critical one is confirmed last and returns last
        side.handle_event(begin(f"s{name}", f"run:{name}", predicted=returns[name]))
        answer(side, side.build_meta())
    rank = bp.eviction_rank(pool)
    first = {name: min(rank[bp.cached_block(pool, h).block_id] for h in hs) for name, hs in chains.items()}
    if critical_last:  # non-critical first (latest return first among them), the critical path last
        assert first["late"] < first["early"] < first["crit"]
    else:  # by predicted return only
        assert first["crit"] < first["late"] < first["early"]
    assert_no_pins(pool)


def test_early_save_keeps_the_tail_that_eviction_would_take(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("t", 4)
    finish_turn(side, pool, hashes, next_tool=10.0)  # the request announced a 10 s tool call
    (job,) = (meta := side.build_meta()).jobs
    assert job.kind == "offload" and len(job.device_blocks) == 4
    # A preemption while the copy is in flight counts the blocks it keeps out of the free queue.
    side.observe_step(BS, num_running=1, preempted={"x"})
    assert side.stats.counter("preemptions.kept.offload_pins") == 1
    assert side.stats.counter("preemptions.offload_pinned_blocks") == 4
    evict_all(pool)  # pressure before stall_begin reaches the engine: the pinned blocks survive
    assert all(bp.cached_block(pool, h) is not None for h in hashes)
    answer(side, meta)
    # Committed before its stall began: held for the session, not the LRU's to reclaim meanwhile.
    assert all(side.host.owners(side.host.lookup(h)) == {"finish:run:A"} for h in hashes)
    assert side.host.num_reclaimable == 0
    evict_all(pool)
    side.handle_event(begin(predicted=10.0))
    side.build_meta()
    assert side.stats.counter("early_save.jobs") == 1
    assert side.stats.counter("stalls.decision.already_on_host") == 1
    assert all(side.host.lookup(h) is not None for h in hashes)  # the whole chain, tail included
    assert all(
        side.host.owners(side.host.lookup(h)) == {stall_owner("s1")} for h in hashes
    )  # the stall's now
    side.handle_event(end())
    side.build_meta()
    nxt = request("r2", [*hashes, *chain("n", 1)], 5 * BS + 1)
    side.on_new_request(nxt)
    assert ask(side, nxt, 0) == 4 * BS
    assert_no_pins(pool)


def test_an_announced_stall_that_never_begins_releases_its_saved_copies(
    pool: BlockPool, clock: Clock
) -> None:
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("w", 2)
    finish_turn(side, pool, hashes, next_tool=10.0)
    answer(side, side.build_meta())
    assert side.host.num_reclaimable == 0
    clock.t += side.opts.keep_after_end_s + 1.5  # no stall_begin (the agent answered instead)
    side.build_meta()
    assert side.host.num_reclaimable == 2 and side.stats.counter("early_save.pins_expired") == 1
    assert all(side.host.lookup(h) is not None for h in hashes)  # still cached for a later hit


def test_early_save_off_copies_nothing_at_finish(pool: BlockPool, clock: Clock) -> None:
    """``early_save=false`` switches the at-finish save off: no copy until the stall itself."""
    side = make_side(pool, clock, prefetch=False, early_save=False)
    hashes = chain("t", 4)
    finish_turn(side, pool, hashes, next_tool=10.0)  # announced: the save would copy here
    assert side.build_meta().jobs == []
    assert side.stats.counter("early_save.jobs") == 0
    assert side.stats.counter("early_save.decision.disabled") == 1
    side.handle_event(begin(predicted=10.0))
    (job,) = side.build_meta().jobs  # the stall's own offload still runs
    assert job.kind == "offload"


def test_stall_begin_during_early_save_does_not_copy_twice(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("u", 3)
    blocks = finish_turn(side, pool, hashes, next_tool=10.0)
    side.handle_event(begin(predicted=10.0))
    meta = side.build_meta()
    assert [j.kind for j in meta.jobs] == ["offload"]  # the early save only
    answer(side, meta)
    # Committed while the stall was active: pinned for it, and the idle blocks demoted.
    assert all(stall_owner("s1") in side.host.owners(side.host.lookup(h)) for h in hashes)
    assert bp.eviction_rank(pool)[blocks[2].block_id] == empty_free_blocks(pool)
    assert_no_pins(pool)


def test_reset_cache_drops_host_copies_and_copies_in_flight(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    old = chain("old", 2)
    finish_turn(side, pool, old)
    side.handle_event(begin())
    answer(side, side.build_meta())
    assert side.host.lookup(old[0]) is not None
    fresh = chain("fresh", 2)
    finish_turn(side, pool, fresh, req_id="r2")
    side.handle_event(begin("s2"))
    in_flight = side.build_meta()  # an offload planned before the reset …
    assert side.device_copies_in_flight() == 1  # (its device blocks stay pinned until reported)
    assert side.reset_cache() is True
    answer(side, in_flight)  # … confirmed after it: committed nothing
    assert side.device_copies_in_flight() == 0
    assert side.host.lookup(old[0]) is None and side.host.lookup(fresh[0]) is None
    req = request("r3", [*old, *chain("n", 1)], 3 * BS + 1)
    side.on_new_request(req)
    assert ask(side, req, 0) == 0  # recompute, never the old KV
    assert side.stats.counter("offload.dropped_after_reset") == 1
    assert side.host.num_ready == 0
    assert_no_pins(pool)


def test_a_device_only_prefix_cache_reset_is_followed_once(pool: BlockPool, clock: Clock) -> None:
    """vLLM resets its block pool without calling ``reset_cache`` (``reset_connector=False``): the
    connector's next hook finds the pool's new epoch and resets the host side as ``reset_cache``
    does. A reset vLLM did pass on (pool reset, then ``reset_cache``) is not done twice."""
    side = make_side(pool, clock, prefetch=False)
    put_on_host(side, chain("old", 2))
    assert not side.follow_pool_reset()
    assert pool.reset_prefix_cache()
    assert side.follow_pool_reset() and not side.follow_pool_reset()
    assert side.host.num_ready == 0
    assert side.stats.counter("reset.count") == 1 and side.stats.counter("reset.device_only") == 1
    put_on_host(side, chain("new", 2))
    assert pool.reset_prefix_cache()
    assert side.reset_cache() and not side.follow_pool_reset()
    assert side.host.num_ready == 0
    assert side.stats.counter("reset.count") == 2 and side.stats.counter("reset.device_only") == 1


def test_a_reset_asks_again_about_a_live_stall_that_relied_on_the_dropped_host_copies(
    pool: BlockPool, clock: Clock
) -> None:
    """An offloaded stall's chain is on host when vLLM resets the prefix cache (new weights): the
    copies are dropped, so the stall is undecided again (its plan and host pins go) and asked at
    the next step — the chain computed under the new weights is saved, not left to eviction."""
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("w", 3)
    finish_turn(side, pool, hashes)
    side.handle_event(begin())
    answer(side, side.build_meta())
    stall = side.stalls.active["s1"]
    assert stall.offloaded and side.planner.is_open("s1")
    assert pool.reset_prefix_cache()
    assert side.follow_pool_reset()
    assert not stall.offloaded and stall.decision is None and not side.planner.is_open("s1")
    assert side.host.owned_by(stall_owner("s1")) == [] and side.stats.counter("reset.stalls_reopened") == 1
    blocks = cache_blocks(pool, hashes)  # the chain computed again, under the new weights
    bp.release(pool, blocks)
    (save,) = side.build_meta().jobs
    assert save.kind == "offload" and save.device_blocks == [b.block_id for b in blocks]
    answer(side, TokenCakeMetadata([save]))
    assert stall.offloaded and all(stall_owner("s1") in side.host.owners(side.host.lookup(h)) for h in hashes)
    assert_no_pins(pool)


def test_a_reset_that_raised_partway_dropped_the_host_copies_and_is_run_again(
    pool: BlockPool, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The core's reset drops the host copies and moves to a new generation before anything that
    could raise; the pool's epoch is recorded only once the reset succeeded, so the next hook's
    ``follow_pool_reset`` runs it again."""
    side = make_side(pool, clock, prefetch=False)
    put_on_host(side, chain("old", 2))
    release = side.holds.release_device_holds

    def broken() -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(side.holds, "release_device_holds", broken)
    assert pool.reset_prefix_cache()
    with pytest.raises(RuntimeError):
        side.follow_pool_reset()
    assert side.host.num_ready == 0 and side.copies.generation == 1
    monkeypatch.setattr(side.holds, "release_device_holds", release)
    assert side.follow_pool_reset() and not side.follow_pool_reset()
    assert side.stats.counter("reset.count") == 1


def test_host_pool_full_at_allocation_is_asked_again(
    pool: BlockPool, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    side = make_side(pool, clock, prefetch=False, host_blocks=4)
    hashes = chain("k", 3)
    finish_turn(side, pool, hashes)
    real = side.host.allocate
    calls = {"n": 0}

    def full_once(n: int, owner: str, victims: Any = ()) -> list[int]:
        calls["n"] += 1
        if calls["n"] == 1:
            from tokencake.serving.host_pool import HostPoolExhausted

            raise HostPoolExhausted("raced")
        return real(n, owner, victims)

    monkeypatch.setattr(side.host, "allocate", full_once)
    side.handle_event(begin())
    assert side.build_meta().jobs == []
    assert side.stats.counter("stalls.decision.host_pool_full_at_alloc") == 1
    clock.t += 1.0
    (job,) = side.build_meta().jobs  # re-evaluated, not parked forever
    answer(side, TokenCakeMetadata([job]))
    assert all(side.host.lookup(h) is not None for h in hashes)
    assert_no_pins(pool)


def _stalled_on_host(side: SchedulerSide, pool: BlockPool, tag: str, n: int, predicted: float) -> list[bytes]:
    """Session ``run:<tag>`` finished a turn of ``n`` blocks and its stall's copy is on host."""
    hashes = chain(tag, n)
    finish_turn(side, pool, hashes, req_id=f"r{tag}", session=f"run:{tag}")
    side.handle_event(begin(f"s{tag}", f"run:{tag}", predicted))
    answer(side, side.build_meta())
    return hashes


def test_a_full_host_pool_keeps_the_sessions_that_return_soonest(pool: BlockPool, clock: Clock) -> None:
    """Belady's rule with the forecasts: a save for a session returning in 5 s takes the host copy
    of one returning in 100 s, tail first (the head stays: a hit needs the chain from block 0),
    and the loser's device blocks go back to the safe end of the eviction queue."""
    side = make_side(pool, clock, prefetch=False, host_blocks=4)
    late = _stalled_on_host(side, pool, "L", 4, predicted=100.0)
    assert side.host.num_free == side.host.num_reclaimable == 0
    soon = _stalled_on_host(side, pool, "S", 3, predicted=5.0)
    assert all(side.host.lookup(h) is not None for h in soon)
    assert side.host.lookup(late[0]) is not None  # the head is kept
    assert all(side.host.lookup(h) is None for h in late[1:])
    assert side.stats.counter("host.preempted_blocks") == 3
    assert side.stats.counter("host.preempted_stalls") == 1
    assert side.host.stats()["preempted"] == 3
    assert "sL" not in side.eviction.demoted  # its device copy is all it has of the tail now
    assert_no_pins(pool)


def test_saved_kv_says_whether_half_the_sessions_chain_is_on_host_from_its_head(
    pool: BlockPool, clock: Clock
) -> None:
    """The spatial score's saved credit: the session's latest chain, from block 0, at least half
    on host — not a session without a stall, nor one whose head copy is gone."""
    side = make_side(pool, clock, prefetch=False, host_blocks=8)
    assert not side.saved_kv("run:N")  # no stall: nothing saved
    hashes = _stalled_on_host(side, pool, "A", 4, predicted=5.0)
    assert side.saved_kv("run:A")  # the tool runs
    side.handle_event(end("sA", "run:A", duration=1.0))
    assert side.saved_kv("run:A")  # the tool returned; its request has not been admitted yet
    side.host.drop(hashes[3])
    side.host.drop(hashes[2])
    assert side.saved_kv("run:A")  # two of four from the head: half
    side.host.drop(hashes[0])
    assert not side.saved_kv("run:A")  # no head: a load cannot start
    before = side.host.stats()
    side.saved_kv("run:A")
    assert side.host.stats() == before  # asking touches nothing


def test_a_save_never_takes_the_copy_of_a_session_returning_sooner(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False, host_blocks=4)
    soon = _stalled_on_host(side, pool, "S", 4, predicted=5.0)
    finish_turn(side, pool, chain("L", 3), req_id="rL", session="run:L")
    side.handle_event(begin("sL", "run:L", 100.0))
    assert side.build_meta().jobs == []  # refused: the pool keeps the sooner return
    assert side.stalls.active["sL"].decision == "host_pool_full"
    assert all(side.host.lookup(h) is not None for h in soon)
    assert side.stats.counter("host.preempted_blocks") == 0
    assert_no_pins(pool)


def test_copies_in_flight_and_waiting_sessions_are_never_preempted(pool: BlockPool, clock: Clock) -> None:
    """A later returner's copy still in flight (its slots owned by the job) and the copy of a
    session whose next request waits (about to be loaded) are not taken; other policies never
    preempt."""
    side = make_side(pool, clock, prefetch=False, host_blocks=4)
    finish_turn(side, pool, chain("L", 4), req_id="rL", session="run:L")
    side.handle_event(begin("sL", "run:L", 100.0))
    in_flight = side.build_meta()  # not answered yet: the slots are filling, owned by the job
    finish_turn(side, pool, chain("S", 3), req_id="rS", session="run:S")
    side.handle_event(begin("sS", "run:S", 5.0))
    assert side.build_meta().jobs == []
    answer(side, in_flight)
    # The later returner's next request is already waiting: its copy is about to be loaded.
    waiting = request("rL2", [*chain("L", 4), *chain("L-new", 1)], 5 * BS + 2, session="run:L")
    side.on_new_request(waiting)
    assert side.offload._host_victims(clock.t + 5.0, "run:S", clock.t) == []
    side.requests.waiting.clear()
    assert len(side.offload._host_victims(clock.t + 5.0, "run:S", clock.t)) == 4
    side.policy.preempts_host = False
    assert side.offload._host_victims(clock.t + 5.0, "run:S", clock.t) == []
    assert_no_pins(pool)


def test_one_failing_completion_does_not_strand_the_batch(
    pool: BlockPool, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    side = make_side(pool, clock, prefetch=False)
    a, b = chain("a", 2), chain("b", 2)
    finish_turn(side, pool, a, req_id="ra")
    finish_turn(side, pool, b, req_id="rb", session="run:B")
    side.handle_event(begin("sa", "run:A"))
    side.handle_event(begin("sb", "run:B"))
    meta = side.build_meta()
    assert len(meta.jobs) == 2
    real = side.copies._complete_offload

    def flaky(job: Any, ok: bool) -> None:
        if job.session_id == "run:A":
            raise RuntimeError("bug")
        real(job, ok)

    monkeypatch.setattr(side.copies, "_complete_offload", flaky)
    answer(side, meta)
    assert side.stats.counter("errors.complete") == 1
    assert all(side.host.lookup(h) is not None for h in b)  # B's good copy was not lost
    assert not side.copies.jobs
    assert_no_pins(pool)


def test_pressure_is_the_risk_of_eviction_not_a_warm_cache(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    side.gate.usage_threshold = 0.5
    side.max_step_tokens = 2 * BS  # one step allocates at most 2 blocks
    # 10 of 15 blocks hold finished, idle prefixes (a warm cache): that alone is no pressure, since
    # all 15 free blocks are evicted before A's, which were used last.
    bp.release(pool, cache_blocks(pool, chain("warm", 10)))
    finish_turn(side, pool, chain("a", 2))
    side.handle_event(begin(predicted=10.0))
    side.build_meta()
    assert side.stats.counter("stalls.decision.no_pressure") == 1
    # A queued request needing 8 blocks: 8 + 2 expected of 15 ahead -> risk 0.67: offload.
    side.on_new_request(request("q", chain("q", 1), 8 * BS, session=None))
    clock.t += 1.0
    (job,) = side.build_meta().jobs
    assert job.kind == "offload"
    answer(side, TokenCakeMetadata([job]))
    assert_no_pins(pool)


def test_allocation_rate_times_the_stall_makes_pressure(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch=False)
    side.gate.usage_threshold = 0.5
    side.max_step_tokens = BS
    finish_turn(side, pool, chain("a", 2))
    side.handle_event(begin(predicted=10.0))
    side.build_meta()
    assert side.stats.counter("stalls.decision.no_pressure") == 1  # an idle engine evicts nothing
    for _ in range(5):  # other traffic: 2 blocks/s -> 2 x 2/s x ~9 s left >> 13 blocks ahead
        clock.t += 0.5
        side.observe_step(BS)
    (job,) = side.build_meta().jobs
    assert job.kind == "offload" and side.stats.counter("stalls.offload_after_retry") == 1
    answer(side, TokenCakeMetadata([job]))
    assert_no_pins(pool)


def test_a_slow_prefetch_is_not_waited_for_forever(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    hashes = _offloaded_and_evicted(side, pool, clock)
    clock.t += 2.0
    (job,) = side.build_meta().jobs
    req = request("r2", [*hashes, *chain("n", 1)], 3 * BS + 1)
    side.on_new_request(req)
    assert ask(side, req, 0) is None
    clock.t += side.opts.prefetch_wait_s + 0.1  # the copy is still not confirmed
    assert ask(side, req, 0) == 2 * BS  # demand load takes over
    loaded = bp.allocate(pool, 3)
    side.update_state_after_alloc(req, [b.block_id for b in loaded], 2 * BS)
    for i, (b, h) in enumerate(zip(loaded[:2], hashes, strict=True)):
        bp.register(pool, b, h, (i + 1) * BS)  # vLLM caches the loaded blocks
    answer(side, side.build_meta())  # the load …
    answer(side, TokenCakeMetadata([job]))  # … and the late prefetch: not published twice
    assert side.stats.counter("prefetch.duplicate_blocks") == 2
    assert not side.holds.kept  # nor held: its request is already running
    assert side.stats.counter("demand_load.gave_up_waiting") == 1
    bp.release(pool, loaded)
    assert_no_pins(pool)


def test_prefetch_lead_covers_the_wait_for_the_next_step(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch_quantile=None, prefetch_margin_s=0.0)
    # Busy steps of 1 s and one 3 s prefill; idle gaps (a step with no work) are not steps.
    for gap, tokens in [(0.0, 8), (1.0, 8), (1.0, 8), (3.0, 2048), (1.0, 8), (30.0, 0), (5.0, 8)]:
        clock.t += gap
        side.observe_step(tokens)
    # E[d^2] / 2E[d] over d = 1, 1, 3, 1: (1 + 1 + 9 + 1) / (2 * 6) = 1.0 s
    assert side.steps.step_wait_s() == pytest.approx(1.0)
    hashes = chain("w", 2)
    finish_turn(side, pool, hashes)
    side.handle_event(begin(predicted=5.0))
    answer(side, side.build_meta())
    evict_all(pool)
    plan = side.planner.get("s1")
    assert plan is not None and plan.lead_s == pytest.approx(1.0, abs=0.01)  # step wait + tiny h2d
    clock.t += 3.9
    assert side.build_meta().jobs == []
    clock.t += 0.2  # past predicted − lead
    (job,) = side.build_meta().jobs
    assert job.kind == "prefetch"


def test_prefetch_aims_before_a_median_forecast(pool: BlockPool, clock: Clock) -> None:
    """Before any history a forecast may be 2× long (prior 0.5): the upload is due at half of it."""
    side = make_side(pool, clock, prefetch_margin_s=0.0)
    finish_turn(side, pool, chain("m", 2))
    side.handle_event(begin(predicted=10.0))
    answer(side, side.build_meta())
    evict_all(pool)
    clock.t += 4.9
    assert side.build_meta().jobs == []
    clock.t += 0.2
    (job,) = side.build_meta().jobs
    assert job.kind == "prefetch"


def test_prefetched_chain_evicted_while_the_tool_runs_comes_back(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch_quantile=None, hold_prefetched=False)
    hashes = chain("e", 2)
    finish_turn(side, pool, hashes)
    side.handle_event(begin(predicted=2.0))
    answer(side, side.build_meta())
    evict_all(pool)
    clock.t += 2.0
    meta = side.build_meta()
    (job,) = meta.jobs
    answer(side, meta)
    assert bp.cached_block(pool, hashes[0]) is not None
    evict_all(pool)  # the tool runs longer than predicted and others churn the cache
    meta = side.build_meta()
    (job2,) = meta.jobs  # due again while the tool still runs
    assert job2.kind == "prefetch" and job2.job_id != job.job_id
    answer(side, meta)
    assert side.planner.stats()["reprefetch_while_running"] == 1
    side.handle_event(end())
    side.build_meta()
    req = request("r2", [*hashes, *chain("n", 1)], 3 * BS + 1)
    side.on_new_request(req)
    assert ask(side, req, 2 * BS) == 0
    side.update_state_after_alloc(req, [], 0)
    assert side.stats.counter("readiness.prefetched") == 1
    assert_no_pins(pool)


def _held_after_prefetch(
    side: SchedulerSide,
    pool: BlockPool,
    clock: Clock,
    name: str,
    session: str,
    stall: str,
    predicted: float,
    n: int = 2,
    critical: bool = False,
) -> list[bytes]:
    hashes = chain(name, n)
    finish_turn(side, pool, hashes, f"r-{name}", session=session, critical=critical)
    side.handle_event(begin(stall, session, predicted))
    answer(side, side.build_meta())
    evict_all(pool)
    clock.t += predicted
    meta = side.build_meta()
    assert [j.kind for j in meta.jobs] == ["prefetch"]
    answer(side, meta)
    assert side.holds.kept[session].kind == "hold"
    return hashes


def test_a_held_prefetch_yields_to_a_request_that_needs_the_room(pool: BlockPool, clock: Clock) -> None:
    """Admission releases holds (latest predicted return first) just enough for the request."""
    side = make_side(pool, clock, prefetch_quantile=None)
    a = _held_after_prefetch(side, pool, clock, "a", "run:A", "sA", 1.0)
    b = _held_after_prefetch(side, pool, clock, "b", "run:B", "sB", 5.0)  # returns last
    assert len(pinned(pool)) == 4 and bp.num_free(pool) == 11
    big = request("big", chain("w", 1), 12 * BS, session=None)  # 12 blocks: one more than is free
    side.on_new_request(big)
    ask(side, big, 0)
    assert "run:B" not in side.holds.kept and "run:A" in side.holds.kept  # B returns last: it goes
    assert side.stats.counter("hold.released.room") == 1 and bp.num_free(pool) == 13
    evict_all(pool)  # vLLM allocates for the big request
    assert bp.cached_block(pool, b[0]) is None and bp.cached_block(pool, a[0]) is not None
    # B's chain was lost while B's tool still runs: the planner uploads it again.
    meta = side.build_meta()
    assert [j.kind for j in meta.jobs] == ["prefetch"]
    assert side.planner.stats()["reprefetch_while_running"] == 1


def test_a_request_that_fits_the_free_blocks_exactly_releases_no_hold(pool: BlockPool, clock: Clock) -> None:
    """Admission counts the blocks as vLLM's ``allocate_slots`` does: a prompt that fills the free
    blocks exactly fits, and no held chain is released for it (the count was one block larger)."""
    side = make_side(pool, clock, prefetch_quantile=None)
    _held_after_prefetch(side, pool, clock, "a", "run:A", "sA", 1.0)
    free = bp.num_free(pool)
    fits = request("fits", chain("w", 1), free * BS, session=None)
    side.on_new_request(fits)
    assert ask(side, fits, 0) == 0
    assert "run:A" in side.holds.kept and side.stats.counter("hold.released.room") == 0
    taken = bp.allocate(pool, free)  # what vLLM allocates for it: every free block, none held
    assert len(taken) == free and "run:A" in side.holds.kept
    bp.release(pool, taken)


@pytest.mark.parametrize("scheduler", [False, True])
def test_a_request_waiting_for_its_own_prefetch_releases_no_other_hold(
    pool: BlockPool, clock: Clock, scheduler: bool
) -> None:
    """It is not admitted this step (it waits for its copy): another session's held chain stays
    (with TokenCake's scheduler its ``admit`` lets it go on to the connector's "not yet")."""
    side = make_side(pool, clock, prefetch_quantile=None)
    if scheduler:
        side.enable_admission_control()
    _held_after_prefetch(side, pool, clock, "b", "run:B", "sB", 1.0)
    hashes = _offloaded_and_evicted(side, pool, clock)  # run:A, a 1 s tool
    clock.t += 1.0
    (job,) = side.build_meta().jobs
    assert job.kind == "prefetch"
    side.handle_event(end(duration=1.0))
    req = request("r2", [*hashes, *chain("n", 1)], 12 * BS)  # more than is free without B's hold
    side.on_new_request(req)
    assert ask(side, req, 0) is None
    assert "run:B" in side.holds.kept and side.stats.counter("hold.released.room") == 0
    assert side.stats.counter("admission.held_back.prefetch") == 1
    answer(side, TokenCakeMetadata([job]))
    assert ask(side, req, 2 * BS) == 0  # its copy landed: a device hit
    assert "run:B" in side.holds.kept  # and it fits beside B's chain


def test_a_hold_that_cannot_make_room_is_not_released(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch_quantile=None)
    _held_after_prefetch(side, pool, clock, "a", "run:A", "sA", 1.0)
    huge = request("huge", chain("w", 1), 40 * BS, session=None)  # never fits in 15 blocks
    side.on_new_request(huge)
    ask(side, huge, 0)
    assert "run:A" in side.holds.kept and len(pinned(pool)) == 2


def test_holds_leave_a_free_block_per_running_request(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch_quantile=None)
    _held_after_prefetch(side, pool, clock, "a", "run:A", "sA", 1.0)
    running = bp.allocate(pool, 12)  # the running requests grew: 1 free block left
    side.observe_step(3, num_running=3)  # and 3 of them may each need one next step
    side.build_meta()
    assert "run:A" not in side.holds.kept and side.stats.counter("hold.released.reserve") == 1
    bp.release(pool, running)
    assert_no_pins(pool)


def _critical_and_other_held(side: SchedulerSide, pool: BlockPool, clock: Clock) -> None:
    """A critical-path session's prefetched chain (returns last) and a non-critical one's, held."""
    take_over(side)  # the spatial scheduler is on
    _held_after_prefetch(side, pool, clock, "b", "run:B", "sB", 1.0)
    _held_after_prefetch(side, pool, clock, "a", "run:A", "sA", 5.0, critical=True)
    assert side.holds.kept["run:A"].critical and not side.holds.kept["run:B"].critical
    assert len(pinned(pool)) == 4 and bp.num_free(pool) == 11
    assert side.reserved_blocks() == 2


def test_the_critical_reserve_is_not_lent_to_a_fresh_non_critical_admission(
    pool: BlockPool, clock: Clock
) -> None:
    side = make_side(pool, clock, prefetch_quantile=None)
    _critical_and_other_held(side, pool, clock)
    big = request("big", chain("w", 1), 14 * BS, session="run:W")  # 14 blocks + 1 spare: all 4 held
    side.on_new_request(big)
    ask(side, big, 0)
    # B's hold alone would not make room and A's is reserved: nothing goes, the request waits.
    assert set(side.holds.kept) == {"run:A", "run:B"}
    assert side.stats.counter("spatial.reserve_denials") == 1
    clock.t += side.opts.critical_reserve_wait_s  # it has waited long enough: the reserve is lent
    ask(side, big, 0)
    assert not side.holds.kept and bp.num_free(pool) == 15
    assert side.stats.counter("hold.released.room") == 2


def test_a_plain_request_is_not_held_back_by_the_critical_reserve(pool: BlockPool, clock: Clock) -> None:
    """Plain requests (no TokenCake metadata) are served first come, first served: one that needs
    the reserved blocks takes them — a denial would let the plain requests behind it go first."""
    side = make_side(pool, clock, prefetch_quantile=None)
    _critical_and_other_held(side, pool, clock)
    big = request("big", chain("w", 1), 14 * BS, session=None)
    side.on_new_request(big)
    assert ask(side, big, 0) == 0
    assert not side.holds.kept and bp.num_free(pool) == 15
    assert side.stats.counter("spatial.reserve_denials") == 0


def test_the_critical_reserve_yields_non_critical_holds_first_and_never_to_critical_requests(
    pool: BlockPool, clock: Clock
) -> None:
    side = make_side(pool, clock, prefetch_quantile=None)
    _critical_and_other_held(side, pool, clock)
    mid = request("mid", chain("m", 1), 12 * BS, session="run:M")  # needs 2 of the 4 held blocks
    side.on_new_request(mid)
    ask(side, mid, 0)
    # B returns sooner but is not on the critical path: its hold goes, A's stays.
    assert set(side.holds.kept) == {"run:A"}
    crit = request("crit", chain("c", 1), 14 * BS, session="run:C", critical=True)
    side.on_new_request(crit)
    ask(side, crit, 0)  # a critical request may take the reserve
    assert not side.holds.kept


def test_the_critical_reserve_is_capped_and_off_without_the_spatial_scheduler(
    pool: BlockPool, clock: Clock
) -> None:
    for critical_last, frac in ((True, 0.1), (False, 0.25)):  # 1 block of 16 < A's 2; or off
        side = make_side(pool, clock, prefetch_quantile=None, critical_reserve_frac=frac)
        _critical_and_other_held(side, pool, clock)
        side.critical_last = side.admission_control = critical_last  # off: vLLM's own scheduler
        big = request(f"big{frac}", chain(f"w{frac}", 1), 14 * BS, session="run:W")
        side.on_new_request(big)
        ask(side, big, 0)
        assert not side.holds.kept, (critical_last, frac)
        assert side.stats.counter("spatial.reserve_denials") == 0
        evict_all(pool)
        assert_no_pins(pool)
        pool = BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, hash_block_size=BS)


def test_a_stuck_engine_releases_the_critical_reserve_too(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch_quantile=None)
    _critical_and_other_held(side, pool, clock)
    side.on_new_request(request("w", chain("w", 1), 14 * BS, session=None))  # waits
    for left in ({"run:A"}, set()):  # an idle step with requests waiting: non-critical goes first
        side.observe_step(0, num_running=0)
        side.build_meta()
        assert set(side.holds.kept) == left
    assert side.stats.counter("hold.released.pressure") == 2
    assert side.stats.histogram("spatial.reserved_frac")["count"] >= 2


def test_held_chains_yield_to_a_running_request_before_vllm_preempts_one(
    pool: BlockPool, clock: Clock
) -> None:
    """vLLM asks ``has_pending_block_frees`` right before it preempts a running request that found
    no free block: held chains (device copies of host KV) go first — latest return first, the
    critical reserve included — one at a time until a block frees, and no waiting request is
    admitted in that pass (the freed blocks are the running request's next step). With nothing
    held left, vLLM preempts as stock vLLM does."""
    side = make_side(pool, clock, prefetch_quantile=None)
    _critical_and_other_held(side, pool, clock)  # B (not critical) and A (critical), 2 blocks each
    running = bp.allocate(pool, bp.num_free(pool))  # the running requests hold every free block
    assert side.free_for_running() is True
    assert set(side.holds.kept) == {"run:A"} and bp.num_free(pool) == 2
    waiting = request("w", chain("w", 1), BS, session=None)
    side.on_new_request(waiting)
    assert ask(side, waiting, 0) is None  # not in this pass
    side.observe_step(BS, num_running=len(running))  # the pass is over
    assert side.admission.keep_free() == bp.num_free(pool) == 2  # its step's prefetches take none of them
    assert ask(side, waiting, 0) == 0
    side.observe_step(BS, num_running=len(running))
    assert side.admission.keep_free() == len(running)  # the next step: the usual rule again
    running += bp.allocate(pool, 2)  # the running request took them; another one is short now
    assert side.free_for_running() is True and not side.holds.kept
    running += bp.allocate(pool, 2)
    assert side.free_for_running() is False  # nothing held: vLLM preempts
    assert side.stats.counter("hold.yielded_to_running") == 2
    assert side.stats.counter("hold.admission_waits_for_running") == 1
    bp.release(pool, running)
    assert_no_pins(pool)


def test_held_chains_yield_what_the_running_requests_need_at_once(pool: BlockPool, clock: Clock) -> None:
    """With TokenCake's scheduler counting what the running requests still need this step
    (``running_need``), held chains yield that much in one go — latest return first — not one
    block's worth per step."""
    side = make_side(pool, clock, prefetch_quantile=None)
    need = [3]
    side.enable_admission_control(running_need=lambda: need[0])
    _held_after_prefetch(side, pool, clock, "b", "run:B", "sB", 1.0)  # returns first
    _held_after_prefetch(side, pool, clock, "c", "run:C", "sC", 2.0)
    _held_after_prefetch(side, pool, clock, "d", "run:D", "sD", 3.0)
    running = bp.allocate(pool, bp.num_free(pool))
    assert side.free_for_running() is True
    assert set(side.holds.kept) == {"run:B"} and bp.num_free(pool) == 4  # two 2-block chains for 3
    need[0] = 0  # (a count below one block still yields one)
    assert side.free_for_running() is True and not side.holds.kept
    assert side.stats.counter("hold.released.running") == 3
    bp.release(pool, running)
    assert_no_pins(pool)


def test_a_failing_running_count_yields_a_block_as_without_it(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, prefetch_quantile=None)

    def broken() -> int:
        raise RuntimeError("boom")

    side.enable_admission_control(running_need=broken)
    _held_after_prefetch(side, pool, clock, "b", "run:B", "sB", 1.0)
    running = bp.allocate(pool, bp.num_free(pool))
    assert side.free_for_running() is True and not side.holds.kept
    assert side.stats.counter("errors.running_need") == 1
    bp.release(pool, running)


def test_a_pass_that_gave_held_blocks_to_a_running_request_holds_admissions_back_a_bounded_time(
    pool: BlockPool, clock: Clock
) -> None:
    """With TokenCake's scheduler no request is admitted in the pass whose held chains yielded to
    a running request (a request that reads no prefix cache included) — for at most
    ``admission_wait_s`` after vLLM first looked at it; then it goes on, as vLLM would admit it."""
    side = make_side(pool, clock, prefetch_quantile=None)
    side.enable_admission_control()
    _held_after_prefetch(side, pool, clock, "b", "run:B", "sB", 1.0)
    running = bp.allocate(pool, bp.num_free(pool))
    waiting = request("w", chain("w", 1), BS, session=None)
    waiting.skip_reading_prefix_cache = True  # prompt_logprobs: vLLM would ignore a "not yet"
    side.on_new_request(waiting)
    assert side.free_for_running() is True
    assert side.admit(waiting, 1) is False
    clock.t += side.opts.admission_wait_s
    assert side.admit(waiting, 1) is True
    assert side.stats.counter("admission.held_back.running") == 1
    assert side.stats.counter("admission.past_bound.running") == 1
    assert side.stats.counter("hold.admission_waits_for_running") == 1
    bp.release(pool, running)
    assert_no_pins(pool)


def test_admission_leaves_a_request_that_holds_kv_to_vllm(pool: BlockPool, clock: Clock) -> None:
    """A waiting request with computed tokens (a finished asynchronous load) holds its blocks
    already: nothing holds it back."""
    side = make_side(pool, clock, prefetch_quantile=None)
    side.enable_admission_control()
    _held_after_prefetch(side, pool, clock, "b", "run:B", "sB", 1.0)
    running = bp.allocate(pool, bp.num_free(pool))
    assert side.free_for_running() is True
    loaded = request("l", chain("l", 2), 2 * BS + 1)
    loaded.num_computed_tokens = 2 * BS
    assert side.admit(loaded, 1) is True
    bp.release(pool, running)


def test_admission_measures_a_prompt_as_vllms_admission_test_does(pool: BlockPool, clock: Clock) -> None:
    """The device prefix hit vLLM's lookup will find (none for a request that reads no prefix
    cache), and the whole prompt when vLLM admits only what fits whole — else this step's chunk,
    past the host-pool hits it loads."""
    side = make_side(pool, clock, prefetch_quantile=None)
    hashes = chain("p", 6)
    blocks = cache_blocks(pool, hashes[:2])
    bp.release(pool, blocks)  # cached, idle: hits that count against the free blocks
    put_on_host(side, hashes[2:4])
    req = request("p", hashes, 6 * BS + 1)
    hits = side.demand.local_hits(req)
    assert hits == hashes[:2]
    assert side.admission._admission_need(req, hits) == (7 - 2 + 2, 2)
    side.max_step_tokens = 2 * BS
    side.full_sequence_must_fit = False
    assert side.admission._admission_need(req, hits) == (6 - 2 + 2, 2)  # 2 hit + 2 on host + a 2-block chunk
    req.skip_reading_prefix_cache = True
    assert side.demand.local_hits(req) == []
    evict_all(pool)


@pytest.mark.parametrize(
    ("lookahead", "watermark", "released"), [(0, 0.0, False), (BS, 0.0, True), (0, 0.1, True)]
)
def test_room_for_an_admission_counts_vllms_lookahead_slots_and_watermark(
    pool: BlockPool, clock: Clock, lookahead: int, watermark: float, released: bool
) -> None:
    """vLLM admits a request only if its prompt's blocks, its speculative lookahead slots and (while
    requests run) the watermark fit: a hold released for less would leave the request failing its
    allocation — and blocking vLLM's admission loop — every step."""
    side = make_side(pool, clock, prefetch_quantile=None)
    _held_after_prefetch(side, pool, clock, "a", "run:A", "sA", 1.0)
    assert bp.num_free(pool) == 13
    side.observe_step(BS, num_running=1)
    side.lookahead_tokens, side.watermark = lookahead, watermark
    req = request("q", chain("q", 1), 13 * BS, session=None)  # 13 blocks: fits only without either
    side.on_new_request(req)
    ask(side, req, 0)
    assert (not side.holds.kept) is released
    evict_all(pool)
    side.release_device_holds()
    assert_no_pins(pool)


# ------------------------------------------------------------------ KV policies (issue 10)
# Every action pins and releases exactly once; offload-all works without events; keeps are soft.


def test_offload_all_stores_requests_without_metadata_and_loads_them_on_a_miss(
    pool: BlockPool, clock: Clock
) -> None:
    side = make_side(pool, clock, policy="offload-all")
    hashes = chain("o", 3)
    finish_turn(side, pool, hashes, "r1", session=None, next_tool=None, admit=True)
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
    assert ask(side, nxt, 0) == 3 * BS
    # The host pool is LRU and unowned: every slot is reclaimable by later stores.
    assert side.host.num_reclaimable == 3


def test_offload_all_ignores_stall_events(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, policy="offload-all")
    hashes = chain("e", 2)
    finish_turn(side, pool, hashes, "r1", session="run:A", next_tool=5.0, admit=True)
    answer(side, side.build_meta())
    side.handle_event(begin("s1", "run:A", 5.0))
    assert side.build_meta().jobs == []
    assert side.stats.counter("stalls.decision.nothing") == 1
    assert not pinned(pool)


# ------------------------------------------------------------------ continuum (keep)


def test_continuum_keeps_the_blocks_for_its_ttl_then_lets_go(pool: BlockPool, clock: Clock) -> None:
    side = make_side(
        pool, clock, policy="continuum", s_per_token=1.0
    )  # recompute 8 tokens = 8 s → TTL ln 8 ≈ 2.1 s
    hashes = chain("k", 2)
    blocks = finish_turn(side, pool, hashes, "r1", session="run:A", next_tool=5.0, admit=True)
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
    side = make_side(pool, clock, policy="continuum", s_per_token=1.0)
    hashes = chain("a", 2)
    finish_turn(side, pool, hashes, "r1", session="run:A", next_tool=1.0, admit=True)
    side.handle_event(begin("s1", "run:A", 1.0))
    side.build_meta()
    side.handle_event(end("s1", "run:A", 1.0))
    side.build_meta()
    nxt = request("r2", [*hashes, *chain("n", 1)], 3 * BS + 1, "run:A", None)
    side.on_new_request(nxt)
    assert ask(side, nxt, 2 * BS) == 0
    held = [bp.cached_block(pool, h) for h in hashes]
    bp.pin(pool, held)  # what vLLM's allocate_slots does for the prefix hit
    side.update_state_after_alloc(nxt, [], 0)
    assert side.stats.counter("keep.released.admitted") == 1
    assert [b.ref_cnt for b in held] == [1, 1]  # only the request's own references remain
    assert side.stats.counter("next_turn.prefix_tokens_device") == 2 * BS
    bp.release(pool, held)
    assert not pinned(pool)


def test_a_keep_never_stops_every_request_from_running(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, policy="continuum", s_per_token=1.0)
    finish_turn(side, pool, chain("a", 2), "r1", session="run:A", next_tool=60.0, admit=True)
    finish_turn(side, pool, chain("b", 2), "r2", session="run:B", next_tool=60.0, admit=True)
    assert len(pinned(pool)) == 4
    side.on_new_request(request("big", chain("w", 1), 14 * BS, None, None))  # needs the kept blocks
    side.observe_step(0)  # the engine computed nothing this step: it cannot admit anything
    side.build_meta()
    assert side.stats.counter("keep.released.pressure") == 1 and len(pinned(pool)) == 2
    side.observe_step(0)
    side.build_meta()
    assert not pinned(pool)


def test_a_kept_session_that_never_returns_lets_go_soon_after_its_tool(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, policy="continuum", s_per_token=100.0, keep_after_end_s=2.0)
    finish_turn(side, pool, chain("a", 2), "r1", session="run:A", next_tool=60.0, admit=True)
    side.handle_event(begin("s1", "run:A", 60.0))
    side.build_meta()
    side.handle_event(end("s1", "run:A", 1.0))
    side.build_meta()
    assert len(pinned(pool)) == 2
    clock.t += 2.5
    side.build_meta()
    assert not pinned(pool)


def test_reset_cache_and_shutdown_release_keeps(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, policy="continuum", s_per_token=1.0)
    finish_turn(side, pool, chain("a", 2), "r1", session="run:A", next_tool=60.0, admit=True)
    assert side.reset_cache() and not pinned(pool)
    finish_turn(side, pool, chain("b", 2), "r2", session="run:B", next_tool=60.0, admit=True)
    side.shutdown()
    assert not pinned(pool)


# ------------------------------------------------------------------ infercept


def test_infercept_swaps_a_long_call_and_brings_it_back_when_the_tool_returns(
    pool: BlockPool, clock: Clock
) -> None:
    side = make_side(pool, clock, policy="infercept", s_per_token=1.0)
    hashes = chain("i", 3)
    finish_turn(side, pool, hashes, "r1", session="run:A", next_tool=30.0, admit=True)
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
    assert len(pinned(pool)) == 3  # held for the request that follows
    clock.t += side.opts.keep_after_end_s + 0.1
    side.build_meta()
    assert not pinned(pool)


def test_infercept_discard_puts_the_session_first_in_line(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, policy="infercept", s_per_token=1e-6, host_blocks=0)  # recompute is cheap
    hashes = chain("d", 2)
    finish_turn(side, pool, hashes, "r1", session="run:A", next_tool=30.0, admit=True)
    other = chain("o", 2)
    bp.release(pool, cache_blocks(pool, other))  # idle after A: A would outlive it under LRU
    side.handle_event(begin("s1", "run:A", 30.0))
    side.build_meta()
    assert side.stats.counter("stalls.decision.discard") == 1
    rank = bp.eviction_rank(pool)
    e = empty_free_blocks(pool)
    assert sorted(rank[bp.cached_block(pool, h).block_id] for h in hashes) == [e, e + 1]
    assert not pinned(pool)


# ------------------------------------------------------------------ any decision stays safe


@pytest.mark.parametrize("seed", range(6))
def test_random_decisions_never_leak_a_pin_or_publish_an_unconfirmed_block(
    pool: BlockPool, clock: Clock, seed: int
) -> None:
    """Random policy decisions, copy outcomes, evictions and tool calls (parallel ones too)."""
    rng = random.Random(seed)
    side = make_side(pool, clock, policy="random", policy_seed=seed, host_blocks=10)
    sessions = [f"run:{c}" for c in "ABC"]
    turns = dict.fromkeys(sessions, 0)
    open_calls: dict[str, list[str]] = {}  # session -> its tool calls running
    calls = 0
    pending: list[TokenCakeMetadata] = []
    confirmed: set[bytes] = set()  # hashes of offload copies the worker confirmed

    def settle(meta: TokenCakeMetadata, ok: bool) -> None:
        for j in meta.jobs:
            job = side.copies.jobs.get(j.job_id)
            if ok and job is not None and job.kind == "offload":
                confirmed.update(job.hashes)
        answer(side, meta, ok=ok)

    for _ in range(120):
        s = rng.choice(sessions)
        roll = rng.random()
        if s in open_calls and roll < 0.4:
            running = open_calls[s]
            side.handle_event(end(running.pop(rng.randrange(len(running))), s, rng.uniform(0.1, 5.0)))
            if not running:
                del open_calls[s]
        elif s in open_calls and roll < 0.5:  # a parallel call of the same turn
            calls += 1
            side.handle_event(begin(f"{s}-call{calls}", s, rng.uniform(0.5, 5.0)))
            open_calls[s].append(f"{s}-call{calls}")
        elif s not in open_calls and roll < 0.5 and bp.num_free(pool) >= 4:
            turns[s] += 1
            finish_turn(
                side,
                pool,
                chain(s, rng.randint(1, 3)),
                f"{s}-{turns[s]}",
                session=s,
                next_tool=rng.choice([None, 2.0]),
                admit=True,
            )
            calls += 1
            side.handle_event(begin(f"{s}-call{calls}", s, rng.uniform(0.5, 5.0)))
            open_calls[s] = [f"{s}-call{calls}"]
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
        # One active stall per session, mapping exactly its open calls.
        assert sorted(side.stalls.by_session) == sorted(st.session_id for st in side.stalls.active.values())
        assert side.stalls.by_call == {
            c: st.stall_id for st in side.stalls.active.values() for c in st.calls.open
        }
    for s, running in open_calls.items():
        for sid in running:
            side.handle_event(end(sid, s))
    pending.append(side.build_meta())
    for meta in pending:
        settle(meta, ok=True)
    assert side.stalls.active == {} and side.stalls.by_call == {} and side.stalls.by_session == {}
    side.shutdown()
    assert not pinned(pool), pinned(pool)
    assert not side.copies.jobs


def test_offload_all_lru_loses_tails_first_and_keeps_reused_chains(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock, policy="offload-all", host_blocks=4)
    a, b = chain("A", 2), chain("B", 2)
    finish_turn(side, pool, a, "ra", session=None)
    answer(side, side.build_meta())
    finish_turn(side, pool, b, "rb", session=None)
    answer(side, side.build_meta())
    # A's next request reuses its prefix (device hit): A's host copies become the most recent.
    finish_turn(side, pool, [*a, *chain("A+", 1)], "ra2", session=None)
    (job,) = side.build_meta().jobs  # stores A's new block: reclaims B's tail, not A's chain
    answer(side, TokenCakeMetadata([job]))
    assert all(side.host.lookup(h) is not None for h in a)
    assert side.host.lookup(b[1]) is None and side.host.lookup(b[0]) is not None
    assert_no_pins(pool)


def test_time_to_first_token_of_resumed_turns(pool: BlockPool, clock: Clock) -> None:
    """``next_turn.ttft_s``: arrival → first output token, for a session's turn after its tool only."""
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("ttft", 2)
    first = request("r0", hashes, 2 * BS + 2)
    side.on_new_request(first)
    side.update_state_after_alloc(first, [], 0)
    finish_turn(side, pool, hashes)
    side.handle_event(begin())
    side.build_meta()
    side.handle_event(end())
    side.build_meta()
    req = request("r2", [*hashes, *chain("more", 1)], 3 * BS + 1)
    side.on_new_request(req)
    clock.t += 0.5
    ask(side, req, 2 * BS)
    side.update_state_after_alloc(req, [], 0)
    clock.t += 0.5
    side.build_meta()  # prefill still running: nothing yet
    assert side.stats.histogram("next_turn.ttft_s") == {"count": 0}
    req.num_output_tokens = 1
    clock.t += 0.25
    side.build_meta()
    ttft = side.stats.histogram("next_turn.ttft_s")
    assert ttft["count"] == 1 and ttft["mean"] == pytest.approx(1.25)
    req.num_output_tokens = 5
    side.build_meta()
    side.request_finished(req)
    assert side.stats.histogram("next_turn.ttft_s")["count"] == 1  # once per request
    assert not side.requests.first_token  # a first turn (r0) was never watched


def test_a_retryable_no_backs_off_while_nothing_waits(pool: BlockPool, clock: Clock) -> None:
    """A retryable "no" (here: the host pool cannot take the chain) with no queue is asked again
    after 0.05 s, doubling up to 1 s (each ask walks the chain); a request starting to wait makes
    every backed-off stall be asked at the next step, then every 0.05 s."""
    side = make_side(pool, clock, host_blocks=1)
    finish_turn(side, pool, chain("b", 2))
    side.handle_event(begin(predicted=100.0))
    side.build_meta()
    (stall,) = side.stalls.active.values()
    assert stall.decision == "host_pool_full"
    intervals = []
    for _ in range(7):
        intervals.append(round(stall.next_eval - clock.t, 6))
        clock.t = stall.next_eval
        side.build_meta()
    assert intervals == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    side.on_new_request(request("w", chain("w", 3), 3 * BS + 1, session="run:B"))
    clock.t += 0.01  # long before the backed-off re-ask
    side.build_meta()  # asked at once (still no room), and from now on at the queue's pace
    assert stall.decision == "host_pool_full"
    assert stall.next_eval == pytest.approx(clock.t + 0.05)


def test_queue_wait_by_place_on_the_critical_path(pool: BlockPool, clock: Clock) -> None:
    side = make_side(pool, clock)
    crit = request("c", chain("c", 1), BS + 1, session="run:C")
    crit.kv_transfer_params["tokencake"]["graph"] = {"on_critical_path": True}
    other = request("o", chain("o", 1), BS + 1, session="run:O")
    plain = request("p", chain("p", 1), BS + 1, session=None)
    for r in (crit, other, plain):
        side.on_new_request(r)
    for r, who, wait in ((crit, "critical", 0.5), (other, "noncritical", 1.0), (plain, "plain", 1.5)):
        clock.t += 0.5
        side.update_state_after_alloc(r, [], 0)
        assert side.stats.histogram(f"queue_wait_s.{who}")["mean"] == pytest.approx(wait)
    side.update_state_after_alloc(crit, [], 0)  # re-admitted after a preemption: not a new wait
    assert side.stats.histogram("queue_wait_s.critical")["count"] == 1


def test_critical_inversion_when_a_non_critical_admission_evicts_critical_kv(
    pool: BlockPool, clock: Clock
) -> None:
    """A critical-path session's idle chain loses blocks to a non-critical request's allocation."""
    side = make_side(pool, clock, offload=False)
    hashes = chain("crit", 3)
    first = request("c1", hashes, 3 * BS + 2, session="run:C", next_tool=5.0)
    first.kv_transfer_params["tokencake"]["graph"] = {"on_critical_path": True}
    side.on_new_request(first)
    side.update_state_after_alloc(first, [], 0)
    blocks = cache_blocks(pool, hashes)
    first.num_computed_tokens = 3 * BS + 1
    side.request_finished(first)
    bp.release(pool, blocks)  # idle and cached
    # A critical request's admission that evicts them is no inversion.
    crit = request("c2", chain("c2", 1), BS + 1, session="run:D")
    crit.kv_transfer_params["tokencake"]["graph"] = {"on_critical_path": True}
    side.on_new_request(crit)
    ask(side, crit, 0)
    taken = bp.allocate(pool, bp.num_free(pool) - 2)  # evicts the chain's oldest block
    side.update_state_after_alloc(crit, [], 0)
    assert sum(bp.cached_block(pool, h) is not None for h in hashes) == 2
    assert side.stats.counter("spatial.critical_inversions") == 0
    # A plain request whose allocation takes the rest of C's idle chain is one; one of the two
    # blocks it took has a host copy, the other must be recomputed: an unsaved inversion.
    put_on_host(side, hashes[1:2])
    plain = request("p", chain("p", 2), 2 * BS, session=None)
    side.on_new_request(plain)
    ask(side, plain, 0)
    taken += bp.allocate(pool, 2)
    side.update_state_after_alloc(plain, [], 0)
    assert inversions(side) == (1, 2, 1, 1)
    bp.release(pool, taken)


def test_a_critical_inversion_of_blocks_safe_on_host_costs_no_recompute(
    pool: BlockPool, clock: Clock
) -> None:
    """Every block a non-critical admission took from the critical chain has a host copy: an
    inversion, not an unsaved one (the eviction order lets host-safe blocks go first)."""
    side = make_side(pool, clock, offload=False)
    hashes = chain("safe", 2)
    finish_turn(side, pool, hashes, "c1", session="run:C", next_tool=5.0, critical=True)
    put_on_host(side, hashes)
    other = request("o", chain("o", 1), BS + 1, session="run:O")
    side.on_new_request(other)
    ask(side, other, 0)
    taken = bp.allocate(pool, bp.num_free(pool))  # takes every idle block, the chain included
    side.update_state_after_alloc(other, [], 0)
    assert inversions(side) == (1, 2, 0, 0)
    bp.release(pool, taken)


def test_stalls_are_derived_from_requests_when_the_client_sends_no_events(
    pool: BlockPool, clock: Clock
) -> None:
    """Replicas behind a router: the request that announced its tool call begins the stall when it
    finishes, the session's next request ends it; the policy then works as with events."""
    side = make_side(pool, clock)
    hashes = chain("d", 3)
    first = request("r1", hashes, 3 * BS + 2, next_tool=4.0, events=False)
    side.on_new_request(first)
    side.update_state_after_alloc(first, [], 0)
    blocks = cache_blocks(pool, hashes)
    first.num_computed_tokens = 3 * BS + 1
    side.request_finished(first)
    bp.release(pool, blocks)
    assert side.stats.counter("events.derived_begin") == 1
    side.build_meta()
    (stall,) = side.stalls.active.values()
    assert stall.stall_id == "derived:r1" and stall.tool == "search" and stall.predicted_s == 4.0
    clock.t += 3.0
    nxt = request("r2", [*hashes, *chain("e", 1)], 4 * BS + 1, events=False)
    side.on_new_request(nxt)  # the tool is over
    assert side.stats.counter("events.derived_end") == 1
    ask(side, nxt, 3 * BS)
    admit(side, pool, nxt, hashes)
    assert side.stats.counter("next_turn.requests") == 1
    assert side.stats.counter("next_turn.prefix_tokens_recomputed") == 0
    # A client that sends events gets no derived stall.
    finish_turn(side, pool, chain("w", 2), "r3", session="run:W", next_tool=4.0)
    assert side.stats.counter("events.derived_begin") == 1


def test_request_metadata_has_the_events_length_limits(pool: BlockPool, clock: Clock) -> None:
    """Session and run ids key tables capped by entry count: a megabyte id makes a plain request.
    A next_stall the server could not turn into a stall (a 300-character tool, a negative hint)
    does too, instead of failing the early save when the derived stall is built."""
    from tokencake.serving.vllm.scheduler_side import request_meta

    huge = request("r0", chain("h", 1), BS + 1, session="s" * 100_000)
    assert request_meta(huge) is None
    for bad in ({"tool": "t" * 300, "predicted_s": 4.0}, {"tool": "search", "predicted_s": -1.0}):
        req = request("r1", chain("d", 2), 2 * BS + 2, next_tool=4.0, events=False)
        req.kv_transfer_params["tokencake"]["next_stall"] = bad
        assert request_meta(req) is None
    side = make_side(pool, clock)
    req = request("r2", chain("d", 2), 2 * BS + 2, next_tool=4.0, events=False)
    req.kv_transfer_params["tokencake"]["next_stall"]["tool"] = "t" * 300
    side.on_new_request(req)
    side.update_state_after_alloc(req, [], 0)
    blocks = cache_blocks(pool, chain("d", 2))
    req.num_computed_tokens = 2 * BS + 1
    side.request_finished(req)
    bp.release(pool, blocks)
    assert side.stats.counter("errors.request_finished") == 0


def test_stalls_of_sessions_that_sent_no_request_do_not_teach_the_forecast(
    pool: BlockPool, clock: Clock
) -> None:
    """Forecasts are shared by every session of an agent type and tool: event pairs for made-up
    sessions (no request ever) must not move them; a real session's stall does."""
    side = make_side(pool, clock, prefetch=False)
    for i in range(5):
        side.handle_event(begin(f"x{i}", session="run:nobody", predicted=300.0))
        side.build_meta()
        side.handle_event(end(f"x{i}", session="run:nobody", duration=300.0))
        side.build_meta()
    assert side.forecaster.predict("A", "search").samples == 0  # the events' agent (node "A")
    finish_turn(side, pool, chain("k", 2))
    side.handle_event(begin(predicted=3.0))
    side.build_meta()
    (stall,) = side.stalls.active.values()
    assert side.forecaster.predict(stall.agent_type, "search").samples == 0
    side.handle_event(end(duration=3.0))
    side.build_meta()
    assert side.forecaster.predict(stall.agent_type, "search").samples == 1


def test_recomputed_next_turn_blocks_say_why(pool: BlockPool, clock: Clock) -> None:
    """A resumed session's recomputed prefix blocks are counted by cause: the stall said "no
    pressure" and was never saved; or it was saved and the host copy dropped since."""

    def resume(side: SchedulerSide, hashes: list[bytes], rid: str) -> None:
        side.handle_event(end())
        side.build_meta()
        req = request(rid, [*hashes, *chain(rid, 1)], (len(hashes) + 1) * BS + 1)
        side.on_new_request(req)
        assert ask(side, req, 0) == 0
        side.update_state_after_alloc(req, [], 0)

    side = make_side(pool, clock, prefetch=False, early_save=False)
    side.gate.usage_threshold = 0.99  # an idle engine: no pressure
    side.max_step_tokens = BS
    hashes = chain("np", 2)
    finish_turn(side, pool, hashes, critical=True)
    side.handle_event(begin(predicted=10.0))
    side.build_meta()
    assert side.stats.counter("stalls.decision.no_pressure") == 1
    evict_all(pool)
    resume(side, hashes, "r2")
    assert side.stats.counter("next_turn.prefix_tokens_recomputed") == 2 * BS
    assert side.stats.counter("next_turn.recomputed_why.not_saved.no_pressure") == 2
    # A critical-path session: its recompute is also counted as the critical path's.
    assert side.stats.counter("next_turn.critical.prefix_tokens") == 2 * BS
    assert side.stats.counter("next_turn.critical.prefix_tokens_recomputed") == 2 * BS

    side = make_side(pool, clock, prefetch=False)
    hashes = chain("hd", 2)
    offloaded_then_evicted(side, pool, hashes)
    side.host.reset()  # e.g. /reset_prefix_cache: every host copy invalidated
    resume(side, hashes, "r3")
    assert side.stats.counter("next_turn.recomputed_why.host_dropped") == 2
    assert side.stats.counter("next_turn.critical.prefix_tokens_recomputed") == 0  # not critical


def _admit_after_critical_and_other_idle(
    pool: BlockPool,
    clock: Clock,
    *,
    critical_last: bool,
    on_host: bool = False,
    stall: bool = True,
    silent_s: float = 0.0,
    **opts: Any,
) -> tuple[SchedulerSide, list[bytes], list[bytes]]:
    """A critical-path session away on a tool call (its chain idle, the older one in the free
    queue), then a non-critical session's idle chain; a plain request allocates 12 of the 15
    free blocks: the 9 never used plus 3 more. ``stall=False``: the critical session's
    ``stall_begin`` never came, and ``silent_s`` passed before the plain request."""
    side = make_side(pool, clock, offload=False, **opts)
    if critical_last:  # what SpatialScheduler sets when it takes over admission
        take_over(side)
    crit, other = chain("crit", 3), chain("other", 3)
    finish_turn(side, pool, crit, "c1", session="run:C", next_tool=5.0, critical=True)
    finish_turn(side, pool, other, "o1", session="run:O", next_tool=5.0)
    if stall:
        side.handle_event(begin("sC", "run:C", predicted=5.0))
    clock.t += silent_s
    side.build_meta()
    if on_host:
        put_on_host(side, crit)
    plain = request("p", chain("p", 1), 11 * BS, session=None)  # 11 blocks + 1
    side.on_new_request(plain)
    ask(side, plain, 0)
    taken = bp.allocate(pool, 12)
    side.update_state_after_alloc(plain, [], 0)
    bp.release(pool, taken)
    return side, crit, other


def test_a_non_critical_admission_evicts_other_idle_blocks_before_a_critical_chain_not_on_host(
    pool: BlockPool, clock: Clock
) -> None:
    """With the spatial scheduler on, the critical chain (first in line by LRU) moves behind the
    other session's: the plain request evicts that one instead; no critical inversion."""
    side, crit, other = _admit_after_critical_and_other_idle(pool, clock, critical_last=True)
    assert all(bp.cached_block(pool, h) is not None for h in crit)
    assert all(bp.cached_block(pool, h) is None for h in other)
    assert side.stats.counter("spatial.critical_spared_blocks") == 3
    assert side.stats.counter("spatial.critical_inversions") == 0


def test_without_the_spatial_scheduler_the_lru_order_stays(pool: BlockPool, clock: Clock) -> None:
    side, crit, _other = _admit_after_critical_and_other_idle(pool, clock, critical_last=False)
    assert all(bp.cached_block(pool, h) is None for h in crit)  # vLLM's LRU: the older chain goes
    assert side.stats.counter("spatial.critical_inversions_unsaved") == 1


def test_a_critical_chain_safe_on_host_keeps_its_place(pool: BlockPool, clock: Clock) -> None:
    side, crit, _other = _admit_after_critical_and_other_idle(pool, clock, critical_last=True, on_host=True)
    # Safe on host: a copy brings it back, so it keeps its place and goes first.
    assert all(bp.cached_block(pool, h) is None for h in crit)
    assert side.stats.counter("spatial.critical_spared_blocks") == 0
    assert side.stats.counter("spatial.critical_inversions") == 1
    assert side.stats.counter("spatial.critical_inversions_unsaved") == 0


def test_critical_spare_late_moves_a_host_safe_critical_chain_behind_other_blocks(
    pool: BlockPool, clock: Clock
) -> None:
    """``critical_spare_late``: an admission that may not wait (a plain request here) evicts the
    other idle chain before a returning critical session's host-safe one, and is not delayed."""
    side, crit, other = _admit_after_critical_and_other_idle(
        pool, clock, critical_last=True, on_host=True, critical_spare_late=True
    )
    assert all(bp.cached_block(pool, h) is not None for h in crit)
    assert all(bp.cached_block(pool, h) is None for h in other)
    assert side.stats.counter("spatial.critical_spared_blocks") == 3
    assert side.stats.counter("spatial.critical_inversions") == 0
    assert side.stats.counter("spatial.critical_reserve_waits") == 0


def _reserve_case(
    pool: BlockPool,
    clock: Clock,
    *,
    blocks: int,
    slack: float = 5.0,
    running: int = 1,
    crit_blocks: int = 3,
    shares_prompt: bool = False,
    **opts: Any,
) -> tuple[SchedulerSide, Any, list[bytes], list[bytes]]:
    """A critical-path session away on a tool call with its chain safe on host (the older idle
    chain), a non-critical session's idle chain, and a non-critical agent request (``slack`` s)
    asking for ``blocks`` of the 15 free blocks (9 never used) while ``running`` requests run.
    ``shares_prompt``: the request's prompt starts with the critical chain (a shared prompt)."""
    side = make_side(pool, clock, offload=False, **opts)
    take_over(side)
    crit, other = chain("crit", crit_blocks), chain("other", 3)
    finish_turn(side, pool, crit, "c1", session="run:C", next_tool=5.0, critical=True)
    finish_turn(side, pool, other, "o1", session="run:O", next_tool=5.0)
    side.handle_event(begin("sC", "run:C", predicted=5.0))
    side.build_meta()
    put_on_host(side, crit)
    side.observe_step(BS, num_running=running)
    prompt = (crit if shares_prompt else []) + chain("n", 1)
    req = request("n", prompt, blocks * BS, session="run:N", slack=slack)
    side.on_new_request(req)
    return side, req, crit, other


def test_an_admission_that_may_wait_takes_other_idle_blocks_before_a_reserved_critical_chain(
    pool: BlockPool, clock: Clock
) -> None:
    """Within its slack, a non-critical request evicts the other idle chain rather than the
    critical one, even though the critical chain is safe on host: no critical inversion."""
    side, req, crit, other = _reserve_case(pool, clock, blocks=12)
    assert ask(side, req, 0) == 0  # admitted now: 12 other blocks are free
    taken = bp.allocate(pool, 12)
    side.update_state_after_alloc(req, [], 0)
    bp.release(pool, taken)
    assert all(bp.cached_block(pool, h) is not None for h in crit)
    assert all(bp.cached_block(pool, h) is None for h in other)
    assert inversions(side) == (0, 0, 0, 0)
    assert side.stats.counter("spatial.critical_reserve_waits") == 0


def test_an_admission_waits_for_the_critical_reserve_within_its_slack_then_is_admitted(
    pool: BlockPool, clock: Clock
) -> None:
    """Only the critical chain could make room: the request waits (None: asked again next step)
    while it has slack left, then is admitted and takes it (a reload, not a recompute)."""
    side, req, _crit, _other = _reserve_case(pool, clock, blocks=14, slack=2.0)
    assert ask(side, req, 0) is None
    clock.t += 1.0
    assert ask(side, req, 0) is None
    assert side.stats.counter("spatial.critical_reserve_waits") == 2
    assert side.stats.counter("spatial.critical_reserve_waited_requests") == 1
    clock.t += 1.5  # its slack is spent: the reserve is lent
    assert ask(side, req, 0) == 0
    taken = bp.allocate(pool, 14)
    side.update_state_after_alloc(req, [], 0)
    bp.release(pool, taken)
    assert inversions(side)[0] == 1 and inversions(side)[2] == 0  # host-safe: no recompute
    assert side.stats.counter("spatial.critical_inversions_late") == 1  # past its slack


@pytest.mark.parametrize(("wait_from", "waits"), [("arrival", False), ("head", True)])
def test_the_reserve_clock_starts_at_arrival_or_at_the_first_look(
    pool: BlockPool, clock: Clock, wait_from: str, waits: bool
) -> None:
    """A request that queued behind others for longer than its slack before vLLM first looked at
    it: counted from arrival its slack is spent (admitted at once, a late inversion); counted
    from the head of the queue (``critical_reserve_wait_from = "head"``) it may still wait its
    slack for the critical reserve, and only then takes the chain."""
    side, req, _crit, _other = _reserve_case(
        pool, clock, blocks=14, slack=2.0, critical_reserve_wait_from=wait_from
    )
    clock.t += 3.0  # queued behind other requests: vLLM's admission has not looked at it yet
    if waits:
        assert ask(side, req, 0) is None
        clock.t += 1.5
        assert ask(side, req, 0) is None
        assert side.stats.counter("spatial.critical_reserve_waited_requests") == 1
        clock.t += 1.0  # its slack is spent at the head too: the reserve is lent
    assert ask(side, req, 0) == 0
    taken = bp.allocate(pool, 14)
    side.update_state_after_alloc(req, [], 0)
    bp.release(pool, taken)
    assert inversions(side)[0] == 1
    assert side.stats.counter("spatial.critical_inversions_late") == 1
    assert side.stats.counter("spatial.critical_reserve_waits") == (2 if waits else 0)
    assert not side.requests.first_look and not side.requests.arrival


@pytest.mark.parametrize(
    ("case", "kw", "plain", "late"),
    [
        ("within its slack, reserve off: it could have waited", {"critical_reserve_frac": 0.0}, False, 0),
        ("no slack left", {"slack": 0.0}, False, 1),
        ("engine idle: waiting would idle it", {"running": 0}, False, 1),
        ("a plain request never waits", {}, True, 1),
    ],
)
def test_a_critical_inversion_is_late_when_the_admission_could_not_have_waited(
    pool: BlockPool, clock: Clock, case: str, kw: dict[str, Any], plain: bool, late: int
) -> None:
    """``critical_inversions_late`` splits the inversions the critical reserve may not prevent
    (waiting longer would delay the admitted request's own app) from those it could have."""
    side, req, _crit, _other = _reserve_case(pool, clock, **{"blocks": 14, **kw})
    if plain:
        req = request("p", chain("p", 1), 13 * BS, session=None)
        side.on_new_request(req)
    assert ask(side, req, 0) == 0, case
    taken = bp.allocate(pool, 14)  # the critical chain's blocks included
    side.update_state_after_alloc(req, [], 0)
    bp.release(pool, taken)
    assert inversions(side)[0] == 1, case
    assert side.stats.counter("spatial.critical_inversions_late") == late, case


@pytest.mark.parametrize(
    ("case", "kw"),
    [
        ("no slack", {"slack": 0.0}),
        ("engine idle: nothing runs to free blocks", {"running": 0}),
        ("no reserve", {"critical_reserve_frac": 0.0}),
        ("wait bound", {"slack": 60.0, "critical_reserve_wait_s": 0.0}),
        ("it does not fit anyway (vLLM's queue order decides)", {"blocks": 16}),
    ],
)
def test_an_admission_does_not_wait_for_the_reserve(
    pool: BlockPool, clock: Clock, case: str, kw: dict[str, Any]
) -> None:
    side, req, _crit, _other = _reserve_case(pool, clock, **{"blocks": 14, **kw})
    assert ask(side, req, 0) == 0, case
    assert side.stats.counter("spatial.critical_reserve_waits") == 0


def test_an_admission_does_not_wait_for_a_reserved_chain_that_is_its_own_prefix_hit(
    pool: BlockPool, clock: Clock
) -> None:
    """A shared system prompt: the critical session's idle chain is the non-critical request's
    own device prefix hit. vLLM takes those blocks for the request before it allocates, so the
    admission can never evict them: nothing to wait for, nothing to spare, no inversion."""
    # 15 blocks asked: the 2 it hits (the critical chain) and 12 fresh + 1 of the 13 other free
    # blocks (10 never used, the other chain).
    side, req, crit, _other = _reserve_case(pool, clock, blocks=15, crit_blocks=2, shares_prompt=True)
    assert ask(side, req, 2 * BS) == 0
    assert side.stats.counter("spatial.critical_reserve_waits") == 0
    assert side.stats.counter("spatial.critical_spared_blocks") == 0
    hits = [bp.cached_block(pool, h) for h in crit]
    bp.pin(pool, hits)  # as vLLM's allocate_slots touches the request's hits first
    taken = bp.allocate(pool, 12)
    side.update_state_after_alloc(req, [], 0)
    assert all(bp.cached_block(pool, h) is not None for h in crit)
    assert inversions(side)[0] == 0
    bp.release(pool, taken + hits)


def test_a_plain_request_never_waits_for_the_reserve(pool: BlockPool, clock: Clock) -> None:
    side, _req, crit, _other = _reserve_case(pool, clock, blocks=14)
    plain = request("p", chain("p", 1), 13 * BS, session=None)
    side.on_new_request(plain)
    assert ask(side, plain, 0) == 0
    assert side.stats.counter("spatial.critical_reserve_waits") == 0
    taken = bp.allocate(pool, 12)  # host-safe: the critical chain keeps its place (first out)
    bp.release(pool, taken)
    assert all(bp.cached_block(pool, h) is None for h in crit)


def test_the_critical_hash_index_follows_the_watched_chains(pool: BlockPool, clock: Clock) -> None:
    """Watched when a critical request with an announced tool call finishes; forgotten when its
    session is admitted again or pushed out of the watch by newer ones."""
    side = make_side(pool, clock, offload=False)
    side.critical.idle.max_items = 2
    chains = {sid: chain(sid, 2) for sid in ("run:A", "run:B", "run:C")}
    for i, (sid, hashes) in enumerate(chains.items()):
        finish_turn(side, pool, hashes, f"r{i}", session=sid, next_tool=5.0, critical=True)
    assert set(side.critical.owners) == {*chains["run:B"], *chains["run:C"]}  # A pushed out
    again = request("r9", [*chains["run:B"], *chain("b2", 1)], 3 * BS + 1, session="run:B")
    side.on_new_request(again)
    side.update_state_after_alloc(again, [], 0)
    assert set(side.critical.owners) == set(chains["run:C"])
    assert all(side.critical.owners[h] == {"run:C"} for h in chains["run:C"])


def test_a_critical_chain_is_spared_before_its_stall_begins_not_after_it_went_silent(
    pool: BlockPool, clock: Clock
) -> None:
    """The request announced its tool call: the chain is expected back even before the stall event
    arrives — but not once the announced call's stall expiry has passed with no sign of it."""
    side, crit, _other = _admit_after_critical_and_other_idle(pool, clock, critical_last=True, stall=False)
    assert all(bp.cached_block(pool, h) is not None for h in crit)
    assert side.stats.counter("spatial.critical_spared_blocks") == 3


def test_a_silent_critical_session_is_not_spared(pool: BlockPool, clock: Clock) -> None:
    gone = 61.0  # past the 5 s tool's stall expiry (at least expiry_min_s = 60 s)
    side, crit, _other = _admit_after_critical_and_other_idle(
        pool, clock, critical_last=True, stall=False, silent_s=gone
    )
    assert all(bp.cached_block(pool, h) is None for h in crit)
    assert side.stats.counter("spatial.critical_spared_blocks") == 0


def test_a_chain_cut_before_the_stall_was_decided_names_the_finish_decision(
    pool: BlockPool, clock: Clock
) -> None:
    """The finish found no pressure (and no host room to spare), the chain was evicted before
    ``stall_begin``: the resumed turn's recompute is ``lost_before_decision``, after ``no_pressure``."""
    side = make_side(pool, clock, host_blocks=1, prefetch=False)
    side.gate.usage_threshold = 0.99  # an idle engine: no pressure
    side.max_step_tokens = BS
    hashes = chain("cut", 2)
    finish_turn(side, pool, hashes, next_tool=10.0)
    assert side.stats.counter("early_save.decision.no_pressure") == 1
    evict_all(pool)  # before stall_begin reaches the engine
    side.handle_event(begin(predicted=10.0))
    side.build_meta()
    side.handle_event(end())
    side.build_meta()
    req = request("r2", [*hashes, *chain("r2", 1)], 3 * BS + 1)
    side.on_new_request(req)
    assert ask(side, req, 0) == 0
    side.update_state_after_alloc(req, [], 0)
    assert side.stats.counter("next_turn.recomputed_why.lost_before_decision") == 2
    assert side.stats.counter("next_turn.lost_before_decision_after.no_pressure") == 2


def test_a_stall_named_like_a_copy_job_cannot_unpin_that_jobs_slots(pool: BlockPool, clock: Clock) -> None:
    # Stall ids come from clients; job owners are "job:<n>". A tenant's stall named after a
    # demand load in flight must not own its slots: releasing the stall would hand the slots to
    # the next save while the load still reads them.
    side = make_side(pool, clock, prefetch=False)
    hashes = chain("v", 2)
    put_on_host(side, hashes)
    load_req = request("rv", [*hashes, *chain("vn", 1)], 3 * BS + 2, session="run:V")
    side.on_new_request(load_req)
    assert ask(side, load_req, 0) == 2 * BS
    allocated = bp.allocate(pool, 3)
    side.update_state_after_alloc(load_req, [b.block_id for b in allocated], 2 * BS)
    (load,) = side.build_meta().jobs
    assert load.kind == "load"
    job_owner = f"job:{load.job_id}"
    assert len(side.host.owned_by(job_owner)) == 2
    # Another tenant: same prefix, a stall named after the job, then its next request.
    finish_turn(side, pool, hashes, "rx", session="run:X")
    assert side.handle_event(begin(job_owner, session="run:X")).ok
    side.build_meta()
    side.handle_event(end(job_owner, session="run:X"))
    side.build_meta()
    nxt = request("rx2", [*hashes, *chain("x", 1)], 3 * BS + 2, session="run:X")
    side.on_new_request(nxt)
    ask(side, nxt, 2 * BS)
    admit(side, pool, nxt, hashes)
    side.request_finished(nxt)
    side.build_meta()
    assert len(side.host.owned_by(job_owner)) == 2  # the load still reads them
    assert side.host.num_reclaimable == 0
    answer(side, TokenCakeMetadata([load]))
    bp.release(pool, allocated)


# ------------------------------------------------------------- review of the holds and reserve
# Each test failed on the code before its fix (stop 33's review of the spatial glue).


def test_holds_sharing_blocks_free_them_when_released_together(pool: BlockPool, clock: Clock) -> None:
    """Two sessions' holds over a shared system prompt reference its blocks twice: neither hold
    alone frees them, both together do (a request that needs both must get them)."""
    side = make_side(pool, clock)
    shared, a, b = bp.allocate(pool, 1), bp.allocate(pool, 1), bp.allocate(pool, 1)
    shared[0].ref_cnt += 1  # the second hold's reference
    keep_a = Keep("A", [*shared, *a], until=1e9, since=0.0)
    keep_b = Keep("B", [*shared, *b], until=1e9, since=0.0)
    side.holds.kept.update(A=keep_a, B=keep_b)
    counts = side.holds.counts
    assert keep_a.releasable == keep_b.releasable == 1
    assert counts.without(frozenset({"B"}), "") == counts.without(frozenset({"A"}), "") == 1
    assert counts.without(frozenset(), "") == 3
    shared[0].ref_cnt += 1  # a running request reads it too: releasing the holds does not free it
    side.update_state_after_alloc(request("r", chain("r", 1), BS), [], 0)  # (its allocation)
    assert counts.without(frozenset(), "") == 2


def test_a_preempted_request_counts_as_waiting_so_an_idle_engine_releases_holds(
    pool: BlockPool, clock: Clock
) -> None:
    """vLLM puts a preempted request back in its queue without telling the connector; with only
    that request waiting and the engine idle, a hold must still yield (not wait for its TTL)."""
    side = make_side(pool, clock, prefetch_quantile=None)
    _held_after_prefetch(side, pool, clock, "a", "run:A", "sA", 60.0)
    req = request("p", chain("p", 1), 4 * BS, session=None)
    side.on_new_request(req)
    ask(side, req, 0)
    side.update_state_after_alloc(req, [], 0)
    assert not side.requests.waiting
    side.observe_step(4 * BS, num_running=1)
    side.observe_step(0, num_running=0, preempted={"p"})
    assert side.requests.waiting == {"p": 4}
    # What the extension kept out of the free queue when vLLM preempted: the hold, no copy pins.
    assert (
        side.stats.counter("preemptions.requests") == 1 and side.stats.counter("preemptions.kept.holds") == 1
    )
    assert side.stats.counter("preemptions.held_blocks") > 0
    assert (
        side.stats.counter("preemptions.kept.offload_pins")
        == side.stats.counter("preemptions.kept.none")
        == 0
    )
    side.build_meta()
    assert "run:A" not in side.holds.kept and side.stats.counter("hold.released.pressure") == 1
    side.request_finished(req)  # aborted while waiting: nothing left behind
    assert not side.requests.waiting and not side.requests.admitted


def test_a_reserve_denial_lets_vllm_look_at_the_next_request(pool: BlockPool, clock: Clock) -> None:
    """A fresh non-critical request that only fits with the critical reserve waits a step (None):
    a failed allocation would stop vLLM's admission loop for every smaller request behind it."""
    side = make_side(pool, clock, prefetch_quantile=None)
    _critical_and_other_held(side, pool, clock)
    big = request("big", chain("w", 1), 14 * BS, session="run:W")
    side.on_new_request(big)
    assert ask(side, big, 0) is None
    assert side.stats.counter("spatial.reserve_denials") == 1
    small = request("small", chain("s", 1), 4 * BS, session=None)  # fits in the free blocks
    side.on_new_request(small)
    assert ask(side, small, 0) == 0
    assert set(side.holds.kept) == {"run:A", "run:B"}


def test_released_holds_go_before_the_spared_critical_chain(pool: BlockPool, clock: Clock) -> None:
    """A request needs a non-critical hold released: the released blocks join the free queue's
    back, behind the critical chain the admission spared; they must be taken before it."""
    side = make_side(pool, clock, prefetch_quantile=None)
    _held_after_prefetch(side, pool, clock, "b", "run:B", "sB", 60.0, n=5)
    take_over(side)
    crit = chain("crit", 3)
    finish_turn(side, pool, crit, "c1", session="run:C", next_tool=60.0, critical=True)
    side.handle_event(begin("sC", "run:C", predicted=60.0))
    answer(side, side.build_meta())
    assert all(bp.cached_block(pool, h) is not None for h in crit)
    side.observe_step(BS, num_running=1)
    free = bp.num_free(pool)
    req = request("n", chain("n", 1), free * BS + 1, session="run:N", slack=30.0)  # needs free + 1
    side.on_new_request(req)
    assert ask(side, req, 0) == 0
    assert "run:B" not in side.holds.kept
    taken = bp.allocate(pool, free + 1)  # what vLLM allocates for it
    assert all(bp.cached_block(pool, h) is not None for h in crit)
    bp.release(pool, taken)


def test_a_chain_still_on_device_is_never_counted_as_having_no_room(pool: BlockPool, clock: Clock) -> None:
    """``readiness.no_room`` means a prefetch could not have been made at arrival; a chain that
    needs no copy had room whatever the queue needed (it was filed as no_room_not_needed)."""
    side = make_side(pool, clock, offload=False)
    hashes = chain("a", 3)
    finish_turn(side, pool, hashes, "r1", session="run:A", next_tool=5.0)
    side.handle_event(begin("sA", "run:A", predicted=5.0))
    side.build_meta()
    big = request("big", chain("w", 1), 14 * BS, session=None)  # the queue wants every free block
    side.on_new_request(big)
    assert all(bp.cached_block(pool, h) is not None for h in hashes)
    assert side.readiness.room_for_chain("run:A", "r2") is True


def test_no_room_keeps_a_block_free_per_running_request_as_the_prefetch_budget_does(
    pool: BlockPool, clock: Clock
) -> None:
    """``readiness.no_room`` and the prefetch budget share one rule (``_keep_free``): a chain the
    budget would not upload because the running requests' decode blocks must stay free has no room
    at arrival either (the readiness test used to leave the running requests' term out)."""
    side = make_side(pool, clock)
    hashes = _offloaded_and_evicted(side, pool, clock)
    free = bp.num_free(pool)
    side.observe_step(BS, num_running=free - 1)  # one block short for the two-block chain
    assert side.readiness.room_for_chain("run:A", "r2") is False
    side.observe_step(BS, num_running=free - 2)
    assert side.readiness.room_for_chain("run:A", "r2") is True
    clock.t += 2.0
    side.handle_event(end(duration=2.0))
    side.observe_step(BS, num_running=free)
    assert side.build_meta().jobs == []  # the budget agrees: no block to spare, nothing uploaded
    assert side.stats.counter("prefetch.deferred.headroom") == 1
    assert all(bp.cached_block(pool, h) is None for h in hashes)


def test_readiness_is_judged_when_the_request_arrives_not_when_vllm_first_asks(
    pool: BlockPool, clock: Clock
) -> None:
    """Room at arrival is taken at arrival: a queue that builds up after the request came does not
    excuse a miss (readiness.no_room), however late vLLM first asks about it."""
    side = make_side(pool, clock)
    hashes = _offloaded_and_evicted(side, pool, clock)
    clock.t += 2.0
    side.handle_event(end(duration=2.0))
    req = request("r2", [*hashes, *chain("n", 1)], 3 * BS + 1)
    side.on_new_request(req)  # its chain is on host only, nothing loading, the device has room
    side.on_new_request(request("big", chain("w", 1), 14 * BS, session=None))  # then the queue fills
    assert side.readiness.room_for_chain("run:A", "r2") is False  # what a first-ask check would have seen
    assert ask(side, req, 0) == 2 * BS
    allocated = bp.allocate(pool, 3)
    side.update_state_after_alloc(req, [b.block_id for b in allocated], 2 * BS)
    assert side.stats.counter("readiness.eligible") == 1
    assert side.stats.counter("readiness.missed") == 1
    assert side.stats.counter("readiness.no_room") == 0


def test_a_prefetch_that_lands_while_the_request_queues_was_not_ready_for_it(
    pool: BlockPool, clock: Clock
) -> None:
    """The blocks must be on device (or loading) when the request arrives; one uploaded while it
    waited in the queue served it, but it was not ready (a ``missed``, not ``prefetched``)."""
    side = make_side(pool, clock)
    hashes = _offloaded_and_evicted(side, pool, clock)
    clock.t += 2.0
    side.handle_event(end(duration=2.0))
    req = request("r2", [*hashes, *chain("n", 1)], 3 * BS + 1)
    side.on_new_request(req)
    (job,) = side.build_meta().jobs  # the upload starts only after the request came
    assert job.kind == "prefetch"
    answer(side, TokenCakeMetadata([job]))
    assert ask(side, req, 2 * BS) == 0  # a device hit by admission
    side.update_state_after_alloc(req, [], 0)
    assert side.stats.counter("readiness.eligible") == 1
    assert side.stats.counter("readiness.prefetched") == 0
    assert side.stats.counter("readiness.missed") == 1
    # Why: what the plan was when the request came (its upload was not yet started), not the
    # state it reached while the request queued.
    whys = {k: v for k, v in side.stats.snapshot()["counters"].items() if "missed_why" in k}
    assert whys == {"readiness.missed_why.early_return": 1}, whys
    assert side.stats.counter("next_turn.prefix_tokens_recomputed") == 0


# ---- room kept ahead of returns (``return_reserve``)


def _returning_case(
    pool: BlockPool, clock: Clock, mode: str = "on", *, scheduler: bool = True
) -> tuple[SchedulerSide, list[bytes]]:
    """Session A's 3-block chain is on host only while its 4 s tool runs (due at 2 s, late end
    at 8 s by the prior), one request runs, and the clock is at A's due time. ``scheduler``:
    TokenCake's scheduler applies admission control (it keeps room only then)."""
    side = make_side(pool, clock, return_reserve=mode)
    if scheduler:
        side.enable_admission_control()
    return side, _due_return(side, pool, clock)


def _due_return(side: SchedulerSide, pool: BlockPool, clock: Clock) -> list[bytes]:
    """``_returning_case`` on a given connector."""
    hashes = chain("ret", 3)
    finish_turn(side, pool, hashes)
    side.handle_event(begin(predicted=4.0))
    answer(side, side.build_meta())
    evict_all(pool)
    side.observe_step(BS, num_running=1)
    plan = side.planner.get("s1")
    assert plan is not None and plan.late_at == pytest.approx(plan.begin_at + 8.0)
    clock.t = plan.due_at + 0.01
    return hashes


def test_return_reserve_is_auto_by_where_copies_run() -> None:
    """``auto`` keeps room ahead of returns where copies run on CUDA side streams only."""

    def side(cuda: bool, mode: str) -> SchedulerSide:
        opts = Options(return_reserve=mode)
        return SchedulerSide(
            block_size=BS, block_bytes=1000, num_host_blocks=4, options=opts, device_is_cuda=cuda
        )

    assert side(True, "auto").reserves_returns and not side(False, "auto").reserves_returns
    assert side(False, "on").reserves_returns and not side(True, "off").reserves_returns


def test_a_due_return_is_prefetched_ahead_of_the_queue_and_its_room_kept(
    pool: BlockPool, clock: Clock
) -> None:
    """Kept room: the due chain is uploaded whole although a queued agent request wants the room,
    the request waits (its first admission) while the chain is held, and goes once the likely
    return is past (``late_at``)."""
    side, _hashes = _returning_case(pool, clock)
    queued = request("q", chain("w", 1), 14 * BS, session="run:W")
    side.on_new_request(queued)
    (job,) = side.build_meta().jobs
    assert job.kind == "prefetch" and len(job.device_blocks) == 3  # the whole chain, not its head
    answer(side, TokenCakeMetadata([job]))
    assert "run:A" in side.holds.kept and "run:A" in side.admission.returning
    assert ask(side, queued, 0) is None  # A's hold is not given to it
    assert side.stats.counter("return_reserve.denials") == 1 and "run:A" in side.holds.kept
    plan = side.planner.get("s1")
    assert plan is not None
    clock.t = plan.late_at + 0.01  # the tool ran past its likely return: the room is lent
    side.build_meta()
    assert side.admission.returning == {}
    assert ask(side, queued, 0) == 0 and "run:A" not in side.holds.kept


@pytest.mark.parametrize(("mode", "scheduler"), [("off", True), ("on", False)])
def test_without_kept_room_the_queue_gets_the_blocks_first(
    pool: BlockPool, clock: Clock, mode: str, scheduler: bool
) -> None:
    """The same case with ``return_reserve=off``, or without TokenCake's scheduler (nothing could
    hold an admission back for the room): the budget leaves the queue its demand (the chain's
    head only) and the queued request takes the held head."""
    side, _hashes = _returning_case(pool, clock, mode=mode, scheduler=scheduler)
    queued = request("q", chain("w", 1), 14 * BS, session="run:W")
    side.on_new_request(queued)
    (job,) = side.build_meta().jobs
    assert len(job.device_blocks) == 1 and side.stats.counter("prefetch.partial") == 1
    assert side.admission.returning == {}
    answer(side, TokenCakeMetadata([job]))
    assert ask(side, queued, 0) == 0  # it fits beside the head
    assert side.stats.counter("return_reserve.denials") == 0


def test_kept_room_holds_back_only_an_agent_requests_first_admission(pool: BlockPool, clock: Clock) -> None:
    """Before the chain is back (the running requests hold the device, so even the kept room's
    upload is deferred): an agent request that would leave fewer free blocks than the chain
    misses waits; one that leaves enough goes; a plain request, the session's own request and a
    request with nothing running never wait."""
    side, hashes = _returning_case(pool, clock)
    running = bp.allocate(pool, 14)  # one block free, one request running: no budget
    assert side.build_meta().jobs == [] and side.admission.returning == {"run:A": 3}
    bp.release(pool, running[:10])  # running requests finished: 11 free
    big = request("big", chain("w", 1), 9 * BS, session="run:W")  # would leave 2 < 3
    side.on_new_request(big)
    assert ask(side, big, 0) is None
    small = request("small", chain("s", 1), 8 * BS, session="run:S")  # leaves 3
    side.on_new_request(small)
    assert ask(side, small, 0) == 0
    plain = request("plain", chain("p", 1), 9 * BS, session=None)
    side.on_new_request(plain)
    assert ask(side, plain, 0) == 0
    own = request("own", [*hashes, *chain("own", 1)], 9 * BS + 2, session="run:A")
    side.on_new_request(own)
    assert ask(side, own, 0) == 3 * BS  # its own chain: loaded, not held back
    assert side.stats.counter("return_reserve.denials") == 1
    side.observe_step(0, num_running=0)  # nothing runs: waiting would idle the engine
    assert ask(side, big, 0) == 0
    bp.release(pool, running[10:])


def test_while_room_is_kept_an_admission_releases_no_hold(pool: BlockPool, clock: Clock) -> None:
    """Held chains are of sessions about to return too: an admission that would fit beside the
    kept room only by releasing another session's hold waits instead (releasing it moved
    readiness from one return to another: 79 % instead of 85 % on the simulator's H200 stress
    model at 64 agents)."""
    side = make_side(pool, clock, return_reserve="on")
    side.enable_admission_control()
    _held_after_prefetch(side, pool, clock, "b", "run:B", "sB", 1.0)  # B's likely return is past
    _due_return(side, pool, clock)
    running = bp.allocate(pool, bp.num_free(pool) - 1)  # no budget for A's upload
    assert side.build_meta().jobs == [] and side.admission.returning == {"run:A": 3}
    bp.release(pool, running[:10])  # 11 free, B holds 2
    w = request("w", chain("w", 1), 10 * BS, session="run:W")  # 10 blocks + A's 3 > 11 free
    side.on_new_request(w)
    assert ask(side, w, 0) is None
    assert "run:B" in side.holds.kept and side.stats.counter("return_reserve.denials") == 1
    fits = request("fits", chain("f", 1), 8 * BS, session="run:F")  # 8 + 3 = 11: fits beside it
    side.on_new_request(fits)
    assert ask(side, fits, 0) == 0 and "run:B" in side.holds.kept
    bp.release(pool, running[10:])


def test_an_upload_in_flight_counts_against_the_kept_room(pool: BlockPool, clock: Clock) -> None:
    """The blocks an upload of the chain is copying into are taken already: the return keeps
    only what is still missing (it counted them twice until the copy landed)."""
    side, _hashes = _returning_case(pool, clock)
    (job,) = side.build_meta().jobs  # the due upload: all 3 blocks, copy in flight
    assert job.kind == "prefetch" and side.admission.returning == {"run:A": 3}  # taken before the upload
    side.build_meta()
    assert side.admission.returning == {}  # 3 missing - 3 being copied
    answer(side, TokenCakeMetadata([job]))
    side.build_meta()
    assert side.admission.returning == {} and "run:A" in side.holds.kept  # held now


# ---- concurrent tool calls of one session (the SDK runs a turn's tool calls at once)


def _parallel_calls(
    side: SchedulerSide, pool: BlockPool, first: float, second: float
) -> tuple[list[bytes], Any]:
    """Session A's 3-block chain; tool calls ``A`` (``first`` s, search) and ``B`` (``second`` s,
    fetch) begin together; the chain is offloaded (once) and evicted from device."""
    hashes = chain("par", 3)
    finish_turn(side, pool, hashes)
    side.handle_event(begin("A", predicted=first, tool="search"))
    side.handle_event(begin("B", predicted=second, tool="fetch"))
    meta = side.build_meta()
    (job,) = meta.jobs  # one chain, one copy
    assert job.kind == "offload"
    answer(side, meta)
    evict_all(pool)
    stall = side.stalls.active_of("run:A")
    assert stall is not None and stall.stall_id == "A" and list(side.stalls.active) == ["A"]
    assert len(side.host.owned_by(stall_owner("A"))) == 3 and side.host.owned_by(stall_owner("B")) == []
    assert side.stats.counter("stalls.joined") == 1
    assert side.stats.counter("stalls.decision.offload") == 1  # one chain, decided once
    return hashes, stall


def _samples(side: SchedulerSide, tool: str) -> int:
    """Durations the forecaster learned for ``tool`` (agent type ``A``, the begins' node)."""
    key = side.forecaster.key_stats("A", tool)
    return 0 if key is None else int(key["samples"])


def _resume(side: SchedulerSide, pool: BlockPool, hashes: list[bytes], on_device: bool) -> Any:
    """The session's next request arrives and is admitted (a demand load when not on device)."""
    req = request("r2", [*hashes, *chain("n", 1)], 4 * BS + 1)
    side.on_new_request(req)
    if on_device:
        assert side.get_num_new_matched_tokens(req, 3 * BS) == 0
        admit(side, pool, req, hashes)
        return req
    assert side.get_num_new_matched_tokens(req, 0) == 3 * BS
    allocated = bp.allocate(pool, 5)
    side.update_state_after_alloc(req, [b.block_id for b in allocated], 3 * BS)
    (load,) = side.build_meta().jobs
    answer(side, TokenCakeMetadata([load]))
    bp.release(pool, allocated)
    return req


def _nothing_left(side: SchedulerSide, pool: BlockPool, clock: Clock) -> None:
    """No stall open or eligible for kept room, no call mapped, no host or device pin left."""
    assert side.stalls.active == {} and side.stalls.by_session == {} and side.stalls.by_call == {}
    assert side.admission.reserve_returns(clock.t) == {} and side.admission.returning == {}
    assert side.host.owned_by(stall_owner("A")) == [] and side.host.owned_by(stall_owner("B")) == []
    assert side.host.num_reclaimable == side.host.num_blocks - side.host.num_free
    assert_no_pins(pool)


def test_parallel_tool_calls_share_one_stall_due_back_when_the_last_returns(
    pool: BlockPool, clock: Clock
) -> None:
    """Begin A (5 s), begin B (20 s), end A, end B: one stall, offloaded once, uploaded for B's
    return (not A's), open until B ends; each call teaches its own tool's forecast; the next
    request is accounted once and releases everything."""
    side = make_side(pool, clock, return_reserve="on")
    hashes, stall = _parallel_calls(side, pool, 5.0, 20.0)
    plan = side.planner.get("A")
    assert plan is not None and plan.due_at == pytest.approx(plan.begin_at + 10.0 - plan.lead_s)
    assert plan.late_at == pytest.approx(plan.begin_at + 40.0) and stall.predicted_s == pytest.approx(20.0)
    assert side.planner.get("B") is None
    clock.t += 6.0
    side.handle_event(end("A", duration=6.0, tool="search"))
    assert side.build_meta().jobs == []  # A is back, B still runs: nothing due yet
    assert side.stalls.active_of("run:A") is stall and stall.ended_at is None
    assert (_samples(side, "search"), _samples(side, "fetch")) == (1, 0)
    assert side.admission.returning == {}
    clock.t = plan.due_at + 0.01
    (job,) = side.build_meta().jobs
    assert job.kind == "prefetch" and job.device_blocks
    answer(side, TokenCakeMetadata([job]))
    clock.t += 10.0
    side.handle_event(end("B", duration=20.0, tool="fetch"))
    side.build_meta()
    assert side.stalls.active_of("run:A") is None and stall.ended_at == clock.t
    assert (_samples(side, "search"), _samples(side, "fetch")) == (1, 1)
    assert side.planner.stats()["return_ratio_samples"] == 2  # one per call, with its own forecast
    _resume(side, pool, hashes, on_device=True)
    assert side.stats.counter("next_turn.requests") == 1
    assert side.stats.counter("readiness.eligible") == 1 and side.stats.counter("readiness.prefetched") == 1
    assert side.planner.counts()["on_time"] == 1 and side.planner.counts()["planned"] == 1
    assert side.stats.counter("stalls.final_decision.offload") == 1
    assert side.stats.counter("events.inferred_end") == 0
    _nothing_left(side, pool, clock)


def test_a_parallel_call_ending_first_keeps_the_stall_open_for_the_other(
    pool: BlockPool, clock: Clock
) -> None:
    """Begin A (20 s), begin B (5 s), end B: the stall stays open (A runs) and stays mapped to
    the session, so when A's end is lost the next request still ends it; A's late end is a
    duplicate, and nothing stays pinned or eligible for kept room."""
    side = make_side(pool, clock, return_reserve="on")
    hashes, stall = _parallel_calls(side, pool, 20.0, 5.0)
    clock.t += 5.0
    side.handle_event(end("B", duration=5.0, tool="fetch"))
    side.build_meta()
    assert side.stalls.active_of("run:A") is stall and stall.ended_at is None
    assert (_samples(side, "search"), _samples(side, "fetch")) == (0, 1)
    clock.t += 1.0
    _resume(side, pool, hashes, on_device=False)  # A's end never came
    assert side.stats.counter("events.inferred_end") == 1  # A's only: B's end was delivered
    assert stall.ended_at is not None and stall.resumed and stall.accounted
    assert side.stats.counter("next_turn.requests") == 1
    assert side.stats.counter("next_turn.prefix_tokens_recomputed") == 0
    assert side.planner.counts()["superseded_by_request"] == 1
    assert side.handle_event(end("A", duration=30.0, tool="search")).status == "duplicate"
    side.build_meta()
    assert (_samples(side, "search"), _samples(side, "fetch")) == (1, 1)  # the inferred end
    _nothing_left(side, pool, clock)


def test_the_next_request_before_any_parallel_call_ended_ends_them_all_once(
    pool: BlockPool, clock: Clock
) -> None:
    """Both ends lost: the next request ends both calls (one inferred end each), the stall once;
    its plan is classified once and the late ends are duplicates."""
    side = make_side(pool, clock, return_reserve="on")
    hashes, stall = _parallel_calls(side, pool, 5.0, 20.0)
    clock.t += 1.0
    _resume(side, pool, hashes, on_device=False)
    assert side.stats.counter("events.inferred_end") == 2
    assert stall.ended_at is not None and stall.accounted
    assert side.stats.counter("next_turn.requests") == 1
    assert side.planner.counts()["superseded_by_request"] == 1
    assert (_samples(side, "search"), _samples(side, "fetch")) == (1, 1)
    for sid, tool in (("A", "search"), ("B", "fetch")):
        assert side.handle_event(end(sid, duration=30.0, tool=tool)).status == "duplicate"
    side.build_meta()
    _nothing_left(side, pool, clock)


def test_a_parallel_call_without_an_end_expires_alone_while_the_other_runs(
    pool: BlockPool, clock: Clock
) -> None:
    """Each call gets exactly one end or expiry: A (5 s) passes its own deadline (60 s) and
    expires while B (100 s, deadline 400 s) runs; the stall then lives on B's schedule alone."""
    side = make_side(pool, clock)
    _hashes, stall = _parallel_calls(side, pool, 5.0, 100.0)
    plan = side.planner.get("A")
    assert plan is not None and plan.expires_at == pytest.approx(plan.begin_at + 400.0)
    clock.t += side.opts.expiry_min_s + 1.0
    answer(side, side.build_meta())  # (B's upload was due at 50 s)
    assert side.stats.counter("stalls.expired.no_stall_end") == 1
    record = side.sessions.stall("A")
    assert record is not None and record.state == "expired"
    assert side.stalls.active_of("run:A") is stall and list(stall.calls.open) == ["B"]
    assert len(side.host.owned_by(stall_owner("A"))) == 3  # the chain stays pinned for B
    side.handle_event(end("A", duration=70.0))  # a late end of an expired call changes nothing
    side.build_meta()
    assert _samples(side, "search") == 0 and side.stalls.active_of("run:A") is stall
    clock.t = plan.begin_at + 400.0
    side.build_meta()
    assert side.stats.counter("stalls.expired.no_stall_end") == 2
    assert side.planner.counts()["expired"] == 1
    _nothing_left(side, pool, clock)


def test_a_longer_parallel_call_asks_again_for_a_stall_too_short_to_offload(
    pool: BlockPool, clock: Clock
) -> None:
    """A's 0.1 ms call is too short to save; B joins with 30 s: the stall is asked again at once
    (not after its retry back-off) and offloaded, timed by B's return."""
    side = make_side(pool, clock)
    finish_turn(side, pool, chain("short", 3))
    side.handle_event(begin("A", predicted=0.0001))
    assert side.build_meta().jobs == []
    stall = side.stalls.active_of("run:A")
    assert stall is not None and stall.decision == "too_short"
    side.handle_event(begin("B", predicted=30.0, tool="fetch"))
    (job,) = side.build_meta().jobs
    assert job.kind == "offload" and stall.decision == "offload"
    plan = side.planner.get("A")
    assert plan is not None and plan.due_at == pytest.approx(plan.begin_at + 15.0 - plan.lead_s, abs=0.01)
    assert side.sessions.stall("B").decision == "offload"  # type: ignore[union-attr]
    answer(side, TokenCakeMetadata([job]))


@pytest.mark.parametrize("end_queued", [False, True])
def test_a_call_begun_after_the_next_turn_does_not_take_that_turns_calls_into_its_stall(
    pool: BlockPool, clock: Clock, end_queued: bool
) -> None:
    """Turn 1's parallel call B begins only after turn 2 was admitted: its stall holds turn 1's
    chain. Turn 2's own call C begins on turn 2's chain, so it does not join B's stall: B is
    over (the session moved on) and ends — on the client's behalf, or with its own end when
    that arrived after C's begin, still queued — and C starts its own stall on the chain it left idle."""
    side = make_side(pool, clock, prefetch=False)
    h1 = chain("t1", 2)
    finish_turn(side, pool, h1, req_id="r1", next_tool=5.0)
    side.handle_event(begin("A"))
    answer(side, side.build_meta())
    side.handle_event(end("A"))
    answer(side, side.build_meta())
    h2 = [*h1, *chain("t2", 2)]
    r2 = request("r2", h2, len(h2) * BS + 2, next_tool=5.0)
    side.on_new_request(r2)
    assert ask(side, r2, 2 * BS) == 0
    admit(side, pool, r2, h1)
    side.handle_event(begin("B"))  # turn 1's parallel call, delivered late
    answer(side, side.build_meta())
    assert side.stalls.active["B"].hashes == tuple(h1)
    blocks = cache_blocks(pool, h2)
    r2.num_computed_tokens = len(h2) * BS + 1
    side.request_finished(r2)
    bp.release(pool, blocks)
    side.handle_event(begin("C"))
    if end_queued:  # B's end arrives after C's begin, before the engine drains either
        side.handle_event(end("B", duration=1.0))
    answer(side, side.build_meta())
    stall = side.stalls.active_of("run:A")
    assert stall is not None and stall.stall_id == "C" and stall.hashes == tuple(h2)
    assert list(side.stalls.active) == ["C"] and side.stalls.get("B").ended_at is not None  # type: ignore[union-attr]
    assert side.stats.counter("stalls.joined") == 0
    assert side.stats.counter("events.inferred_end") == (0 if end_queued else 1)
    assert _samples(side, "search") == 2  # A's end, and B's (its own or the inferred one)
    assert side.handle_event(end("B")).status == "duplicate"
    side.handle_event(end("C"))
    answer(side, side.build_meta())
    assert side.stalls.active == {} and side.stalls.by_call == {}
    assert_no_pins(pool)


def test_derived_tool_calls_of_two_requests_in_flight_share_the_stall_and_end_together(
    pool: BlockPool, clock: Clock
) -> None:
    """Without events, two requests of a session in flight at once each begin a derived call when
    they finish; the second joins the first's stall, and the session's next request ends both."""
    side = make_side(pool, clock)
    hashes = chain("d2", 3)
    reqs = [request(f"r{i}", hashes, 3 * BS + 2, next_tool=4.0, events=False) for i in (1, 2)]
    for req in reqs:
        side.on_new_request(req)
        side.update_state_after_alloc(req, [], 0)
    blocks = cache_blocks(pool, hashes)
    for req in reqs:
        req.num_computed_tokens = 3 * BS + 1
        side.request_finished(req)
    bp.release(pool, blocks)
    side.build_meta()
    (stall,) = side.stalls.active.values()
    assert stall.stall_id == "derived:r1" and list(stall.calls.open) == ["derived:r1", "derived:r2"]
    clock.t += 3.0
    nxt = request("r3", [*hashes, *chain("e", 1)], 4 * BS + 1, events=False)
    side.on_new_request(nxt)
    assert side.stats.counter("events.derived_end") == 2
    side.get_num_new_matched_tokens(nxt, 3 * BS)
    admit(side, pool, nxt, hashes)
    assert stall.ended_at is not None and stall.accounted and side.stalls.active == {}
    assert side.stats.counter("next_turn.requests") == 1
    assert side.sessions.active_stalls() == []
