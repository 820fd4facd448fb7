"""The connector inside vLLM's own ``Scheduler`` (real admission and preemption loop, no model).

The scheduler-side unit tests drive the connector's hooks one by one; these run vLLM 0.32's
``Scheduler.schedule`` / ``update_from_output`` with the connector built by vLLM itself, so the
order in which vLLM calls the hooks within a step is the real one. The model runner is replaced
by a one-token answer per scheduled request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tokencake.serving.kvcore.records import Keep
from tokencake.serving.model import default_model_dir
from tokencake.serving.vllm import _blockpool as bp
from tokencake.serving.vllm.connector import TokenCakeConnector
from tokencake.serving.vllm.metadata import JobResult, TokenCakeMetadata, TokenCakeWorkerMeta
from tokencake.serving.vllm.scheduler import SpatialScheduler
from tokencake.serving.vllm.scheduler_side import SchedulerSide

BS = 16
NUM_BLOCKS = 12


def _config(max_batched_tokens: int) -> VllmConfig:
    model_dir = default_model_dir()
    if not (model_dir / "config.json").exists():
        pytest.skip(f"no model at {model_dir} (make model)")
    cache = CacheConfig(block_size=BS, enable_prefix_caching=True)
    cache.num_gpu_blocks = NUM_BLOCKS
    kvt = KVTransferConfig(
        kv_connector="TokenCakeConnector",
        kv_role="kv_both",
        kv_connector_module_path="tokencake.serving.vllm.connector",
        kv_connector_extra_config={"host_pool_blocks": 16, "wake_idle_engine": False, "events_port": 0},
    )
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), max_model_len=1024, dtype="float32", skip_tokenizer_init=True
        ),
        cache_config=cache,
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_batched_tokens,
            max_num_seqs=16,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=kvt,
    )


@pytest.fixture(scope="module")
def vllm_config() -> VllmConfig:
    return _config(1024)


@pytest.fixture(scope="module")
def chunked_config() -> VllmConfig:
    """A step takes at most 4 blocks' worth of tokens: longer prompts are computed in chunks."""
    return _config(4 * BS)


def _make(vllm_config: VllmConfig, cls: type[Scheduler] = Scheduler) -> Scheduler:
    """vLLM's ``Scheduler`` (``scheduler_cls=None``) or TokenCake's ``SpatialScheduler``."""
    kv = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["l0"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32)
            )
        ],
    )
    sched = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BS,
        log_stats=False,
    )
    assert isinstance(sched.connector, TokenCakeConnector) and sched.connector.sched is not None
    return sched


@pytest.fixture
def scheduler(vllm_config: VllmConfig) -> Iterator[Scheduler]:
    """vLLM's own scheduler (no ``--scheduler-cls``)."""
    sched = _make(vllm_config)
    yield sched
    sched.connector.shutdown()


@pytest.fixture
def spatial(vllm_config: VllmConfig) -> Iterator[Scheduler]:
    """TokenCake's scheduler (what ``tokencake serve`` runs)."""
    sched = _make(vllm_config, SpatialScheduler)
    yield sched
    sched.connector.shutdown()


@pytest.fixture
def chunked(chunked_config: VllmConfig) -> Iterator[Scheduler]:
    """TokenCake's scheduler, with prompts longer than 4 blocks computed in chunks."""
    sched = _make(chunked_config, SpatialScheduler)
    yield sched
    sched.connector.shutdown()


def _request(
    req_id: str,
    tokens: int,
    token: int,
    session: str | None = None,
    *,
    max_tokens: int = 8,
    prompt_logprobs: int | None = None,
) -> Request:
    """A plain request, or an agent request of ``session`` (TokenCake metadata)."""
    init_none_hash(sha256)
    extra = None
    if session is not None:
        meta = {"session_id": session, "run_id": "run", "node": session}
        extra = {"kv_transfer_params": {"tokencake": meta}}
    return Request(
        req_id,
        [token] * tokens,
        SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs, extra_args=extra
        ),
        None,
        arrival_time=time.time(),
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def _step(sched: Scheduler, kv: KVConnectorOutput | None = None) -> SchedulerOutput:
    """One engine step: vLLM schedules, the "model" samples one token per scheduled request
    whose prompt is computed (none for a chunk of a longer prompt)."""
    out = sched.schedule()
    _answer(sched, out, kv)
    return out


def _answer(sched: Scheduler, out: SchedulerOutput, kv: KVConnectorOutput | None = None) -> None:
    """The step's model output for ``out``; ``kv``: what the workers' connectors report with it."""
    ids = list(out.num_scheduled_tokens)
    done = [sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens for r in ids]
    sched.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] if d else [] for d in done],
            kv_connector_output=kv,
        ),
    )


def _on_host(side: SchedulerSide, hashes: list[bytes]) -> None:
    """Host copies of ``hashes``, committed and unowned (as an earlier offload leaves them)."""
    for h in hashes:
        (slot,) = side.host.allocate(1, "test")
        side.host.commit(h, slot)


def _hashes(request: Request, n: int) -> list[bytes]:
    return [bytes(h) for h in request.block_hashes[:n]]


def test_a_held_chain_yields_to_a_running_request_instead_of_a_preemption(spatial: Scheduler) -> None:
    """A running request's next token needs a new block and none is free, but TokenCake holds a
    chain for an idle session: vLLM asks ``has_pending_block_frees`` before it preempts, the hold
    is released, the request waits one step (TokenCake's scheduler admits no one past it into the
    freed blocks) and then decodes — no preemption, nothing recomputed."""
    scheduler = spatial
    conn: Any = scheduler.connector
    side = conn.sched
    pool = side.pool.pool
    r1 = _request("r1", 2 * BS, 3)  # its first decode token starts a third block
    scheduler.add_request(r1)
    assert dict(_step(scheduler).num_scheduled_tokens) == {"r1": 2 * BS}
    now = time.monotonic()
    held = bp.allocate(pool, 2)
    side.holds.kept["run:H"] = Keep("run:H", held, until=now + 60, since=now, rank=now + 5, kind="hold")
    others = bp.allocate(pool, bp.num_free(pool))  # other requests' blocks: none free
    scheduler.add_request(_request("r2", 8, 5))
    out = _step(scheduler)
    assert dict(out.num_scheduled_tokens) == {} and not out.preempted_req_ids
    assert not side.holds.kept and bp.num_free(pool) == 2
    assert side.stats.counter("hold.yielded_to_running") == 1
    assert side.stats.counter("hold.admission_waits_for_running") == 1
    out = _step(scheduler)
    assert dict(out.num_scheduled_tokens) == {"r1": 1, "r2": 8} and not out.preempted_req_ids
    assert r1.num_preemptions == 0 and len(r1.output_token_ids) == 2
    bp.release(pool, others)


def test_tokencakes_scheduler_applies_admission_control(spatial: Scheduler) -> None:
    """The internals it relies on are there on a real scheduler (``check``), and it asks the
    connector about the waiting requests vLLM looks at."""
    from tokencake.serving.vllm import scheduler as tc_scheduler

    assert tc_scheduler.check(spatial) is None
    side: Any = spatial.connector.sched  # type: ignore[union-attr]
    assert side.admission_control and side.critical_last
    spatial.add_request(_request("r1", 2 * BS, 3))
    _step(spatial)
    assert spatial._running_need() == 1  # type: ignore[attr-defined]  # r1's first decode: a 3rd block


def test_without_a_hold_vllm_preempts_as_stock(scheduler: Scheduler) -> None:
    conn: Any = scheduler.connector
    pool = conn.sched.pool.pool
    r1 = _request("r1", 2 * BS, 3)
    scheduler.add_request(r1)
    _step(scheduler)
    others = bp.allocate(pool, bp.num_free(pool))
    out = _step(scheduler)
    assert out.preempted_req_ids == {"r1"} and r1.num_preemptions == 1
    assert conn.sched.stats.counter("hold.yielded_to_running") == 0
    bp.release(pool, others)


def test_an_admission_that_would_take_kept_room_waits_and_vllm_admits_the_next(
    spatial: Scheduler,
) -> None:
    """Room kept for a due return (here 4 blocks): an agent request whose prompt would leave less
    free waits a step (TokenCake's scheduler has vLLM skip it) and vLLM goes on to the next waiting
    request, which fits beside the kept room; a plain request is never held back. Once the agent
    request does not fit even in the kept room, it is vLLM's to turn away (as stock vLLM would)."""
    scheduler = spatial
    conn: Any = scheduler.connector
    side = conn.sched
    side.reserves_returns = True
    side.admission.reserve_returns = lambda now: {"run:A": 4}  # a return due, its chain on host
    pool = side.pool.pool
    scheduler.add_request(_request("r1", 2 * BS, 3))
    _step(scheduler)  # r1 runs: 2 blocks, a third for its next token
    scheduler.add_request(_request("big", 6 * BS, 5, session="run:W"))  # would leave 2 free
    scheduler.add_request(_request("small", 4 * BS, 6, session="run:S"))  # leaves 4
    scheduler.add_request(_request("plain", 3 * BS, 9))  # 3 blocks of the 4 kept: it takes them
    out = _step(scheduler)
    assert set(out.num_scheduled_tokens) == {"r1", "small", "plain"}
    assert side.stats.counter("return_reserve.denials") == 1 and bp.num_free(pool) == 1
    assert [r.request_id for r in scheduler.waiting] == ["big"]
    out = _step(scheduler)
    assert "big" not in out.num_scheduled_tokens
    assert side.stats.counter("return_reserve.denials") == 1  # not for kept room: it does not fit


class _Clock:
    """The scheduler side's clock, moved by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _hold(side: Any, session: str, blocks: int, rank: float = 5.0) -> list[Any]:
    """The KV policy holds ``blocks`` device blocks for idle ``session`` (a kept or prefetched chain)."""
    now = time.monotonic()
    held = bp.allocate(side.pool.pool, blocks)
    side.holds.kept[session] = Keep(session, held, until=now + 600, since=now, rank=now + rank, kind="hold")
    return held


def test_a_prompt_longer_than_a_step_does_not_stop_admissions_while_room_is_kept(
    chunked_config: VllmConfig,
) -> None:
    """vLLM 0.32 admits a request only if its whole prompt fits (``scheduler_reserve_full_isl``),
    though it computes a long one in chunks. With room kept for a due return, an agent prompt
    longer than a step must be measured whole: measured by its first chunk, it went on, vLLM's
    allocation failed and its admission loop stopped, for it and every request behind it, step
    after step. Measured whole, it waits for the kept room (it releases no hold while room is
    kept) and vLLM admits the request behind it; without kept room the hold makes room for it."""
    for kept in (False, True):
        sched = _make(chunked_config, SpatialScheduler)
        side: Any = sched.connector.sched  # type: ignore[union-attr]
        if kept:
            side.reserves_returns = True
            side.admission.reserve_returns = lambda now: {"run:A": 1}  # a return due: 1 block kept for it
        pool = side.pool.pool
        sched.add_request(_request("r1", 20, 3, max_tokens=32))  # 2 blocks, decodes for a while
        _step(sched)
        _hold(side, "run:H", 4)  # an idle session's chain, held (not one whose return is due)
        others = bp.allocate(pool, bp.num_free(pool) - 5)  # 5 free: the long prompt needs 6
        sched.add_request(_request("long", 6 * BS, 5, session="run:W"))  # 96 tokens > a step's 64
        sched.add_request(_request("short", 2 * BS, 6, session="run:S"))
        scheduled: set[str] = set()
        for _ in range(4):
            scheduled |= set(_step(sched).num_scheduled_tokens)
        assert "short" in scheduled, f"kept room {kept}: only {scheduled}"
        if kept:
            assert "long" not in scheduled and "run:H" in side.holds.kept
            assert side.stats.counter("return_reserve.denials") == 4
        else:
            assert "long" in scheduled and "run:H" not in side.holds.kept  # the hold made room for it
        bp.release(pool, others)
        sched.connector.shutdown()  # type: ignore[union-attr]


def test_kept_room_holds_an_admission_back_only_until_its_bound(spatial: Scheduler) -> None:
    """Room kept for due returns can stay kept for a long time (many sessions' windows overlap)
    while other requests run: an agent request it holds back goes on ``admission_wait_s`` after
    vLLM first looked at it, and every step it was held back is counted."""
    side: Any = spatial.connector.sched  # type: ignore[union-attr]
    clock = side.clock = _Clock()
    side.reserves_returns = True
    side.admission.reserve_returns = lambda now: {"run:A": 4}
    pool = side.pool.pool
    spatial.add_request(_request("r1", 20, 3, max_tokens=64))  # runs throughout
    _step(spatial)
    others = bp.allocate(pool, bp.num_free(pool) - 5)  # 5 free: 4 kept
    spatial.add_request(_request("big", 3 * BS, 5, session="run:W"))  # would leave 2 free
    for _ in range(3):
        assert "big" not in _step(spatial).num_scheduled_tokens
        clock.t += 1.0
    bound = side.opts.admission_wait_s
    clock.t += bound
    assert "big" in _step(spatial).num_scheduled_tokens  # waited its bound: the room is lent
    counted = side.stats.counter
    assert counted("return_reserve.denials") == 3 and counted("admission.held_back.return_reserve") == 3
    assert counted("admission.past_bound.return_reserve") == 1
    bp.release(pool, others)


def test_a_prompt_logprobs_request_does_not_take_the_blocks_a_hold_gave_a_running_request(
    spatial: Scheduler,
) -> None:
    """vLLM ignores the connector's "not yet" for a request that reads no prefix cache
    (``prompt_logprobs``): held back by TokenCake's scheduler instead, it does not take the block a
    hold just gave back for a running request, which then decodes instead of being preempted."""
    side: Any = spatial.connector.sched  # type: ignore[union-attr]
    pool = side.pool.pool
    r1 = _request("r1", 2 * BS, 3)  # its first decode token starts a third block
    spatial.add_request(r1)
    _step(spatial)
    _hold(side, "run:H", 1)
    others = bp.allocate(pool, bp.num_free(pool))  # none free
    spatial.add_request(_request("lp", 8, 5, prompt_logprobs=1))  # would take the freed block
    out = _step(spatial)
    assert dict(out.num_scheduled_tokens) == {} and not side.holds.kept  # the hold yielded to r1
    out = _step(spatial)
    assert "r1" in out.num_scheduled_tokens and not out.preempted_req_ids and r1.num_preemptions == 0
    bp.release(pool, others)


def test_held_chains_yield_what_the_running_requests_need_at_once(chunked: Scheduler) -> None:
    """A running prompt's next chunk needs 2 blocks and none is free, but three idle sessions'
    chains are held (a block each): the two that return latest yield in the one step vLLM would
    otherwise preempt, so the chunk runs the next step (not one hold per step, the request stalled
    for each), and the chain back soonest stays."""
    side: Any = chunked.connector.sched  # type: ignore[union-attr]
    pool = side.pool.pool
    r1 = _request("r1", 6 * BS, 3)  # 96 tokens: chunks of 64 (4 blocks), then 32 (2 more)
    chunked.add_request(r1)
    assert dict(_step(chunked).num_scheduled_tokens) == {"r1": 4 * BS}
    for i, rank in enumerate((30.0, 10.0, 20.0)):
        _hold(side, f"run:H{i}", 1, rank=rank)
    others = bp.allocate(pool, bp.num_free(pool))  # none free
    out = _step(chunked)
    assert dict(out.num_scheduled_tokens) == {} and not out.preempted_req_ids
    assert set(side.holds.kept) == {"run:H1"} and side.stats.counter("hold.yielded_to_running") == 1
    out = _step(chunked)
    assert dict(out.num_scheduled_tokens) == {"r1": 2 * BS} and r1.num_preemptions == 0
    bp.release(pool, others)


def test_without_tokencakes_scheduler_nothing_is_held_back(scheduler: Scheduler) -> None:
    """vLLM's own scheduler (``scheduler_cls=None``) ignores the connector's "not yet" for a
    request that reads no prefix cache, so the connector holds nothing back: a held chain still
    yields to a running request, but an admission may take the freed blocks in the same pass.
    What is off is logged once."""
    from unittest import mock

    from tokencake.serving.kvcore import core as scheduler_side

    side: Any = scheduler.connector.sched  # type: ignore[union-attr]
    assert not side.admission_control
    pool = side.pool.pool
    with mock.patch.object(scheduler_side.log, "warning") as warn:
        scheduler.add_request(_request("r1", 2 * BS, 3))
        _step(scheduler)
        _hold(side, "run:H", 2)
        others = bp.allocate(pool, bp.num_free(pool))
        scheduler.add_request(_request("r2", 8, 5))
        out = _step(scheduler)
    assert dict(out.num_scheduled_tokens) == {"r2": 8} and not side.holds.kept
    assert side.stats.counter("hold.yielded_to_running") == 1
    assert side.stats.counter("hold.admission_waits_for_running") == 0
    assert warn.call_count == 1 and "admission control off" in warn.call_args.args[0]
    bp.release(pool, others)


@pytest.mark.parametrize("result_with_ids", [True, False])
def test_a_load_one_rank_failed_leaves_the_prefix_cache_in_the_step_its_failure_arrives(
    scheduler: Scheduler, result_with_ids: bool
) -> None:
    """Tensor parallel: every rank loads its shard of the blocks, and vLLM merges the ranks'
    reports of a step (``KVOutputAggregator``: the union of ``invalid_block_ids``, the merged
    worker meta). Rank 1's load failed; rank 0 reports the job a step later. Under ``recompute``
    vLLM rewinds the request but keeps the blocks' hashes: they must leave the prefix cache (and
    the host copies the pool) in this step, or the next admission on that prefix hits half-bad
    KV. ``result_with_ids``: rank 1's failed result comes with its ids (else only the ids)."""
    conn: Any = scheduler.connector
    side = conn.sched
    side.num_workers = 2
    pool = side.pool.pool
    rb = _request("rb", 3 * BS + 2, 4)
    shared = _hashes(rb, 3)
    _on_host(side, shared)
    scheduler.add_request(rb)
    out = scheduler.schedule()
    assert isinstance(out.kv_connector_metadata, TokenCakeMetadata)
    (load,) = out.kv_connector_metadata.jobs
    assert load.kind == "load" and len(load.device_blocks) == 3
    rank1 = TokenCakeWorkerMeta({load.job_id: JobResult(False, 0.001, 0, "copy failed")})
    _answer(
        scheduler,
        out,
        KVConnectorOutput(
            invalid_block_ids=set(load.device_blocks),
            kv_connector_worker_meta=rank1 if result_with_ids else None,
        ),
    )
    assert rb.num_computed_tokens == 0  # vLLM rewound it (recompute)
    assert all(bp.cached_block(pool, h) is None for h in shared)
    assert all(side.host.lookup(h) is None for h in shared)
    assert side.copies.jobs  # rank 0 may still be copying: the job's pins wait for its report
    # The next admission on the prefix computes it (no device hit, no host hit).
    rc = _request("rc", 3 * BS + 2, 4)
    scheduler.add_request(rc)
    late = TokenCakeWorkerMeta({load.job_id: JobResult(True, 0.001, 0)})  # rank 0's result
    if not result_with_ids:  # both ranks' results, merged (rank 1's failed)
        late = TokenCakeWorkerMeta({load.job_id: JobResult(False, 0.001, 0, "copy failed", workers=2)})
    out = _step(scheduler, KVConnectorOutput(kv_connector_worker_meta=late))
    assert out.kv_connector_metadata.jobs == []
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "rc" and new.num_computed_tokens == 0
    assert not side.copies.jobs and side.stats.counter("load.failed") == 1
    assert side.stats.counter("demand_load.uncached_blocks") == 3  # marked once


@pytest.mark.parametrize("reset_connector", [False, True])
@pytest.mark.parametrize("cls", [Scheduler, SpatialScheduler], ids=["vllm", "spatial"])
def test_a_device_prefix_cache_reset_drops_the_host_copies_too(
    vllm_config: VllmConfig, cls: Any, reset_connector: bool
) -> None:
    """``POST /reset_prefix_cache`` (new weights) defaults to ``reset_connector=False``: vLLM
    resets its block pool and does not call the connector. The host copies hold KV of the old
    weights as much as the device blocks did: a demand load must not serve them afterwards.
    Whichever scheduler class runs, and reset once whichever way vLLM was asked."""
    scheduler = _make(vllm_config, cls)
    try:
        side = scheduler.connector.sched  # type: ignore[union-attr]
        old = _request("r1", 3 * BS + 2, 4)
        _on_host(side, _hashes(old, 3))
        assert scheduler.reset_prefix_cache(reset_connector=reset_connector)
        assert side.stats.counter("reset.count") == (1 if reset_connector else 0)
        scheduler.add_request(old)
        out = _step(scheduler)
        assert out.kv_connector_metadata.jobs == []  # nothing loaded from the host
        (new,) = out.scheduled_new_reqs
        assert new.num_computed_tokens == 0
        assert side.host.num_ready == 0
        assert side.stats.counter("reset.count") == 1
        assert side.stats.counter("tokens.from_host") == 0
    finally:
        scheduler.connector.shutdown()  # type: ignore[union-attr]


@pytest.mark.parametrize("load_ok", [False, True])
def test_under_async_scheduling_no_request_hits_a_load_before_its_result_arrives(load_ok: bool) -> None:
    """vLLM 0.32 schedules step N+1 before step N's output is back (async scheduling, its
    default) and caches a synchronous load's blocks when it allocates them. A request admitted
    in N+1 on the loaded prefix would keep tokens computed from KV the load may not have
    written: when the load's failure arrives vLLM rewinds only the loading request. So the
    request waits ("not yet") until the load reports: after a failure it computes the prefix
    (the blocks left the prefix cache), after a success it hits the loaded blocks."""
    config = _config(1024)
    config.scheduler_config.async_scheduling = True
    sched = _make(config, SpatialScheduler)
    try:
        assert isinstance(sched, AsyncScheduler)
        side: Any = sched.connector.sched  # type: ignore[union-attr]
        side.num_workers = 2
        rb = _request("rb", 3 * BS + 2, 4)
        _on_host(side, _hashes(rb, 3))
        sched.add_request(rb)
        out_n = sched.schedule()
        (load,) = out_n.kv_connector_metadata.jobs
        rc = _request("rc", 3 * BS + 5, 4)  # the same 3-block prefix, another tail
        sched.add_request(rc)
        out_n1 = sched.schedule()  # before step N's output is back
        assert "rc" not in out_n1.num_scheduled_tokens
        assert side.stats.counter("admission.held_back.load_in_flight") == 1
        both = TokenCakeWorkerMeta({load.job_id: JobResult(load_ok, 0.001, 0, None, workers=2)})
        _answer(
            sched,
            out_n,
            KVConnectorOutput(
                invalid_block_ids=set() if load_ok else set(load.device_blocks), kv_connector_worker_meta=both
            ),
        )
        _answer(sched, out_n1)
        out = sched.schedule()
        assert "rc" in out.num_scheduled_tokens
        (new,) = [r for r in out.scheduled_new_reqs if r.req_id == "rc"]
        assert new.num_computed_tokens == (3 * BS if load_ok else 0)
        assert not side.demand.loading
    finally:
        sched.connector.shutdown()  # type: ignore[union-attr]


@pytest.mark.parametrize("hook", ["on_new_request", "admit", "has_pending_block_frees"])
def test_a_device_only_reset_is_followed_before_a_hook_that_may_decide_on_host_copies(
    spatial: Scheduler, hook: str
) -> None:
    """``on_new_request`` and ``admit`` drain queued stall transitions (a stall's offload decision
    counts the host copies it finds), and ``has_pending_block_frees`` may be a step's first hook:
    each applies a device-only prefix-cache reset first, so no decision uses copies of the old
    weights."""
    conn: Any = spatial.connector
    side = conn.sched
    old = _request("r1", 3 * BS + 2, 4, session="run:A")
    _on_host(side, _hashes(old, 3))
    if hook == "admit":
        conn.on_new_request(old)  # it arrived before the reset
    calls = {
        "on_new_request": lambda: conn.on_new_request(old),
        "admit": lambda: conn.admit(old, 0),
        "has_pending_block_frees": conn.has_pending_block_frees,
    }
    assert spatial.reset_prefix_cache()  # reset_connector=False: the connector is not told
    calls[hook]()
    assert side.stats.counter("reset.device_only") == 1 and side.host.num_ready == 0
