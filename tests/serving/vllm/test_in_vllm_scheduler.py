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
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tokencake.serving.kvcore.core import _Keep
from tokencake.serving.model import default_model_dir
from tokencake.serving.vllm import _blockpool as bp
from tokencake.serving.vllm.connector import TokenCakeConnector
from tokencake.serving.vllm.metadata import JobResult, TokenCakeMetadata, TokenCakeWorkerMeta
from tokencake.serving.vllm.scheduler import SpatialScheduler
from tokencake.serving.vllm.scheduler_side import SchedulerSide

BS = 16
NUM_BLOCKS = 12


@pytest.fixture(scope="module")
def vllm_config() -> VllmConfig:
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
            max_num_batched_tokens=1024, max_num_seqs=16, max_model_len=1024, is_encoder_decoder=False
        ),
        kv_transfer_config=kvt,
    )


def _build(vllm_config: VllmConfig, cls: Any = Scheduler) -> Scheduler:
    """vLLM's scheduler (or ``cls``, e.g. TokenCake's ``SpatialScheduler``) with the connector."""
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
    sched = _build(vllm_config)
    yield sched
    sched.connector.shutdown()


def _request(req_id: str, tokens: int, token: int, session: str | None = None) -> Request:
    """A plain request, or an agent request of ``session`` (TokenCake metadata)."""
    init_none_hash(sha256)
    extra = None
    if session is not None:
        meta = {"session_id": session, "run_id": "run", "node": session}
        extra = {"kv_transfer_params": {"tokencake": meta}}
    return Request(
        req_id,
        [token] * tokens,
        SamplingParams(max_tokens=8, ignore_eos=True, extra_args=extra),
        None,
        arrival_time=time.time(),
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def _step(sched: Scheduler, kv: KVConnectorOutput | None = None) -> SchedulerOutput:
    """One engine step: vLLM schedules, the "model" samples one token per scheduled request."""
    out = sched.schedule()
    _answer(sched, out, kv)
    return out


def _answer(sched: Scheduler, out: SchedulerOutput, kv: KVConnectorOutput | None = None) -> None:
    """The step's model output for ``out``; ``kv``: what the workers' connectors report with it."""
    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
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


def test_a_held_chain_yields_to_a_running_request_instead_of_a_preemption(scheduler: Scheduler) -> None:
    """A running request's next token needs a new block and none is free, but TokenCake holds a
    chain for an idle session: vLLM asks ``has_pending_block_frees`` before it preempts, the hold
    is released, the request waits one step (nothing is admitted past it into the freed blocks)
    and then decodes — no preemption, nothing recomputed."""
    conn: Any = scheduler.connector
    side = conn.sched
    pool = side.pool.pool  # vLLM's BlockPool behind the core's adapter
    r1 = _request("r1", 2 * BS, 3)  # its first decode token starts a third block
    scheduler.add_request(r1)
    assert dict(_step(scheduler).num_scheduled_tokens) == {"r1": 2 * BS}
    now = time.monotonic()
    held = bp.allocate(pool, 2)
    side._kept["run:H"] = _Keep("run:H", held, until=now + 60, since=now, rank=now + 5, kind="hold")
    others = bp.allocate(pool, bp.num_free(pool))  # other requests' blocks: none free
    scheduler.add_request(_request("r2", 8, 5))
    out = _step(scheduler)
    assert dict(out.num_scheduled_tokens) == {} and not out.preempted_req_ids
    assert not side._kept and bp.num_free(pool) == 2
    assert side.stats.counter("hold.yielded_to_running") == 1
    assert side.stats.counter("hold.admission_waits_for_running") == 1
    out = _step(scheduler)
    assert dict(out.num_scheduled_tokens) == {"r1": 1, "r2": 8} and not out.preempted_req_ids
    assert r1.num_preemptions == 0 and len(r1.output_token_ids) == 2
    bp.release(pool, others)


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
    scheduler: Scheduler,
) -> None:
    """Room kept for a due return (here 4 blocks): an agent request whose prompt would leave less
    free waits a step (``get_num_new_matched_tokens`` → None) and vLLM goes on to the next waiting
    request, which fits beside the kept room; a plain request is never held back."""
    conn: Any = scheduler.connector
    side = conn.sched
    side.reserves_returns = True
    side._reserve_returns = lambda now: {"run:A": 4}  # a return due, its chain on host
    pool = side.pool.pool  # vLLM's BlockPool behind the core's adapter
    scheduler.add_request(_request("r1", 2 * BS, 3))
    _step(scheduler)  # r1 runs: 2 blocks, a third for its next token
    scheduler.add_request(_request("big", 6 * BS, 5, session="run:W"))  # would leave 2 free
    scheduler.add_request(_request("small", 4 * BS, 6, session="run:S"))  # leaves 4
    out = _step(scheduler)
    assert set(out.num_scheduled_tokens) == {"r1", "small"}
    assert side.stats.counter("return_reserve.denials") == 1 and bp.num_free(pool) == 4
    assert [r.request_id for r in scheduler.waiting] == ["big"]
    plain = _request("plain", 3 * BS, 9)  # 3 blocks of the 4 kept: a plain request takes them
    scheduler.add_request(plain)
    out = _step(scheduler)
    assert "plain" in out.num_scheduled_tokens and "big" not in out.num_scheduled_tokens


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
    assert side._jobs  # rank 0 may still be copying: the job's pins wait for its report
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
    assert not side._jobs and side.stats.counter("load.failed") == 1
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
    scheduler = _build(vllm_config, cls)
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
