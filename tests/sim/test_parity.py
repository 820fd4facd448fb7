"""One scripted trace drives the KV core through both backends, and their decision logs agree.

(a) vLLM 0.32's own ``Scheduler`` with the TokenCake connector (no model: each scheduled request
samples one token per step), stepped with ``schedule`` / ``update_from_output``; (b) the
simulator's engine. Both cores are built alike (``tokencake.sim.kv.build_core``; on the vLLM side
as ``SchedulerSide`` bound to vLLM's ``BlockPool``), on one clock, and both record their
decisions (``KVCore.decisions``). The trace has requests with prompts and block hashes (vLLM's
requests hash their blocks with the simulator's keys), stall begin and end events, copy
completions (a failed prefetch, an offload whose report comes past its timeout), a preemption,
a hold and its release, admission waits, demand loads and a prefix-cache reset.

What the engine model must match for the two to schedule the same things, and what this trace
keeps to: the block size, the token budget and ``max_num_seqs``; no watermark, no lookahead slots;
prompts of at most one chunk (every scheduled request samples a token); FCFS order; vLLM's pool
has one block more (its null block, id 0), so its block ids are the simulator's plus one. The
test plays vLLM's worker with the simulator's copy engine (CPU backend: copies run inside their
step) and the same script of failed and late reports.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request as VllmRequest
from vllm.v1.structured_output import StructuredOutputManager

from tokencake.events import StallBegin, StallEnd
from tokencake.serving.kvcore.wire import CopyJob
from tokencake.serving.model import default_model_dir
from tokencake.serving.options import Options
from tokencake.serving.vllm.metadata import TokenCakeWorkerMeta
from tokencake.serving.vllm.scheduler_side import SchedulerSide
from tokencake.sim.copies import CopyEngine, Report
from tokencake.sim.engine import Engine, Request, Session
from tokencake.sim.kv import build_core
from tokencake.sim.profiles import get_profile
from tokencake.sim.scheduler import StepPlan

BS = 16
BLOCKS = 12  # usable device blocks (vLLM's pool has one more: its null block)
HOST = 24
BUDGET = 256
PROFILE = get_profile("cpu-measured").with_(
    name="parity",
    block_size=BS,
    device_blocks=BLOCKS,
    host_blocks=HOST,
    max_batched_tokens=BUDGET,
    max_num_seqs=16,
    step_s=1.0,
    prefill_s_per_token=0.0,
    attn_s_per_token_ctx=0.0,
    decode_s_per_seq=0.0,
    decode_s_per_ctx_token=0.0,
)
OPTIONS: dict[str, Any] = {"policy": "tokencake", "usage_threshold": 0.0, "job_timeout_s": 3.0}


class ScriptedCopies(CopyEngine):
    """The simulator's copy engine with a script: jobs that fail, and jobs reported only at a
    given time (``hold``: by job id)."""

    def __init__(self, fail: set[int], hold: dict[int, float]) -> None:
        super().__init__(PROFILE)
        self.fail, self.hold = fail, hold

    def submit(self, jobs: list[CopyJob], now: float) -> float:
        seconds = super().submit(jobs, now)
        for c in self._copies:
            if c.job.job_id in self.hold and c.done_at == -math.inf:
                c.done_at = self.hold[c.job.job_id]
        return seconds

    def report(self, now: float) -> Report | None:
        report = super().report(now)
        if report is None:
            return None
        results = {
            jid: replace(res, ok=False, nbytes=0, error="scripted") if jid in self.fail else res
            for jid, res in report.results.items()
        }
        return Report(results)


#: One step as both engines report it: {request: tokens scheduled}, preempted, finished.
Step = tuple[dict[str, int], list[str], list[str]]

#: Job ids the script fails or reports late (the same ids on both sides: the cores agree).
FAIL = {6}
HOLD = {2: 14.0, 6: 11.2}


# ---------------------------------------------------------------- the two backends
class SimBackend:
    def __init__(self) -> None:
        self.engine = Engine(
            PROFILE, options=Options(**OPTIONS), copies=ScriptedCopies(FAIL, HOLD), scheduling="fcfs"
        )
        assert self.engine.core is not None
        self.core = self.engine.core
        self.core.decisions = []
        self.plans: list[StepPlan] = []
        schedule = self.engine.scheduler.schedule

        def keep_plan(now: float) -> StepPlan:
            self.plans.append(schedule(now))
            return self.plans[-1]

        self.engine.scheduler.schedule = keep_plan  # type: ignore[method-assign]

    def at(self, t: float) -> None:
        self.engine.now = t

    def submit(self, req: Request) -> None:
        self.engine.submit(req)

    def event(self, ev: StallBegin | StallEnd) -> None:
        self.core.handle_event(ev)

    def step(self) -> tuple[float, float, Step]:
        start = self.engine.now
        finished = self.engine.step()
        plan = self.plans[-1]
        scheduled = {r.request_id: n for r, n in plan.scheduled}
        preempted = sorted(r.request_id for r in plan.preempted)
        return start, self.engine.now, (scheduled, preempted, sorted(r.request_id for r in finished))

    def reset(self) -> bool:
        return self.engine.reset_prefix_cache()


class VllmBackend:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.t = 0.0
        side = build_core(
            PROFILE,
            Options(**OPTIONS),
            host_blocks=HOST,
            clock=lambda: self.t,
            critical_last=False,
            factory=SchedulerSide,
        )
        side.bind_pool(scheduler.kv_cache_manager.block_pool)
        side.decisions = []
        conn: Any = scheduler.connector
        conn.sched = side  # the connector's hooks now reach this core
        self.core = side
        self.copies = ScriptedCopies(FAIL, HOLD)  # the worker

    def at(self, t: float) -> None:
        self.t = t

    def submit(self, req: Request) -> None:
        session = req.session

        def hasher(r: VllmRequest) -> list[bytes]:
            return [session.key(i) for i in range(len(r.block_hashes), r.num_tokens // BS)]

        params = SamplingParams(
            max_tokens=req.output_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": copy.deepcopy(req.kv_transfer_params)}
            if req.kv_transfer_params
            else None,
        )
        vreq = VllmRequest(
            req.request_id,
            [1] * req.prompt_tokens,
            params,
            None,
            arrival_time=time.time(),
            block_hasher=hasher,
        )
        self.scheduler.add_request(vreq)

    def event(self, ev: StallBegin | StallEnd) -> None:
        self.core.handle_event(ev)

    def step(self, start: float, end: float) -> Step:
        self.t = start
        out = self.scheduler.schedule()
        jobs = list(getattr(out.kv_connector_metadata, "jobs", []))
        self.copies.submit(jobs, start)
        self.t = end
        report = self.copies.report(end)
        ids = list(out.num_scheduled_tokens)
        kv_out = None
        if report is not None:
            kv_out = KVConnectorOutput(kv_connector_worker_meta=TokenCakeWorkerMeta(dict(report.results)))
        result = self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[7] for _ in ids],
                kv_connector_output=kv_out,
            ),
        )
        finished = sorted(o.request_id for outs in result.values() for o in outs.outputs if o.finish_reason)
        return dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids), finished

    def reset(self) -> bool:
        return self.scheduler.reset_prefix_cache(reset_connector=True)


def normalized(decisions: list[dict[str, Any]], block_offset: int) -> list[dict[str, Any]]:
    """vLLM's block ids less its null block's offset."""
    out = []
    for d in decisions:
        d = dict(d)
        if "blocks" in d:
            d["blocks"] = [b - block_offset for b in d["blocks"]]
        out.append(d)
    return out


# ---------------------------------------------------------------- the trace
class Both:
    """Every action on both backends, in lockstep on one clock (the simulator's step times)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.sim, self.vllm = SimBackend(), VllmBackend(scheduler)
        self.rid = 0
        self.preempted: list[str] = []
        self.finished: list[str] = []

    def now(self) -> float:
        return self.sim.engine.now

    def at(self, t: float) -> None:
        assert t >= self.now()
        self.sim.at(t)
        self.vllm.at(t)

    def submit(self, session: Session, prompt: int, out: int, tool: tuple[str, float] | None = None) -> str:
        req = Request(self.rid, session, prompt, out, self.now(), tool, run_id=session.run_id)
        self.rid += 1
        self.sim.submit(req)
        self.vllm.submit(req)
        return req.request_id

    def begin(self, session: Session, stall_id: str, tool: str, hint: float) -> None:
        ev = StallBegin(
            stall_id=stall_id,
            session_id=session.session_id,
            run_id=session.run_id,
            node=session.node,
            agent_type=session.agent_type,
            tool=tool,
            predicted_s=hint,
            ts=self.now(),
        )
        self.sim.event(ev)
        self.vllm.event(ev)

    def end(self, session: Session, stall_id: str, tool: str, duration: float) -> None:
        ev = StallEnd(
            stall_id=stall_id,
            session_id=session.session_id,
            run_id=session.run_id,
            node=session.node,
            tool=tool,
            duration_s=duration,
            ts=self.now(),
        )
        self.sim.event(ev)
        self.vllm.event(ev)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            start, end, step = self.sim.step()
            assert self.vllm.step(start, end) == step, f"the engines scheduled differently at {start} s"
            self.preempted += step[1]
            self.finished += step[2]

    def until(self, t: float) -> None:
        """Step while there is work, then idle to ``t`` and step once (the core's wake-up)."""
        while self.sim.engine.has_work() and self.now() < t:
            self.step()
        if self.now() < t:
            self.at(t)
            self.step()


def agent(name: str) -> Session:
    return Session(f"run:{name}", "worker", BS, run_id="run", node=name)


def play(both: Both) -> None:
    a, b, e = agent("a"), agent("b"), agent("e")
    both.submit(a, 40, 2, ("search", 8.0))
    both.submit(b, 40, 2, ("fetch", 30.0))
    both.submit(e, 24, 2, ("search", 5.0))
    both.submit(Session("plain", "", BS), 20, 2)  # a plain request: no metadata
    both.step(2)  # each finishes; the announced tool calls' chains are saved at once (jobs 1-3)
    both.begin(a, "st-a", "search", 8.0)
    both.begin(b, "st-b", "fetch", 30.0)  # its save is reported only past its timeout
    both.begin(e, "st-e", "search", 5.0)
    both.step()
    # Pressure while the tools run: two long requests take the device (the idle chains go); at
    # their first decode the later one is preempted, and runs again once the first is done.
    both.submit(agent("c"), 80, 4)
    both.submit(agent("d"), 80, 4)
    both.until(6.9)  # e's prefetch falls due before its predicted return: uploaded, then held
    both.end(e, "st-e", "search", 5.0)
    both.submit(e, 60, 2)  # admitted: the hold is released
    both.until(9.8)  # a's prefetch is in flight (reported late, failed) ...
    both.end(a, "st-a", "search", 8.0)
    both.submit(a, 70, 2)  # ... its request waits for it, then loads on demand
    both.until(13.0)
    assert not both.sim.engine.has_work()
    # b's save still pins its blocks: the device keeps its cache, the host pool is dropped.
    assert both.sim.reset() is both.vllm.reset() is False
    both.until(14.5)  # b's late report: nothing from before the reset is committed
    both.end(b, "st-b", "fetch", 12.5)
    both.submit(b, 60, 2)
    both.until(17.0)


@pytest.fixture(scope="module")
def vllm_config() -> VllmConfig:
    model_dir = default_model_dir()
    if not (model_dir / "config.json").exists():
        pytest.skip(f"no model at {model_dir} (make model)")
    cache = CacheConfig(block_size=BS, enable_prefix_caching=True)
    cache.num_gpu_blocks = BLOCKS + 1
    kvt = KVTransferConfig(
        kv_connector="TokenCakeConnector",
        kv_role="kv_both",
        kv_connector_module_path="tokencake.serving.vllm.connector",
        kv_connector_extra_config={"host_pool_blocks": HOST, "wake_idle_engine": False},
    )
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), max_model_len=1024, dtype="float32", skip_tokenizer_init=True
        ),
        cache_config=cache,
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=BUDGET, max_num_seqs=16, max_model_len=1024, is_encoder_decoder=False
        ),
        kv_transfer_config=kvt,
    )


@pytest.fixture
def scheduler(vllm_config: VllmConfig) -> Iterator[Scheduler]:
    kv = KVCacheConfig(
        num_blocks=BLOCKS + 1,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["l0"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32)
            )
        ],
    )
    sched = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BS,
        log_stats=False,
    )
    yield sched
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_the_simulator_and_vllm_drive_the_core_to_the_same_decisions(scheduler: Scheduler) -> None:
    both = Both(scheduler)
    play(both)
    sim_log = normalized(both.sim.core.decisions or [], 0)
    vllm_log = normalized(both.vllm.core.decisions or [], 1)
    for i, (s, v) in enumerate(zip(sim_log, vllm_log, strict=False)):
        assert s == v, f"decision {i} differs"
    assert len(sim_log) == len(vllm_log)
    # The trace reaches every kind of decision it is meant to.
    whats = {d["what"] for d in sim_log}
    assert whats >= {"job", "hold", "release", "wait", "complete", "commit", "publish", "timeout", "reset"}
    kinds = {d["kind"] for d in sim_log if d["what"] == "job"}
    assert kinds == {"offload", "prefetch", "load"}
    assert any(d["what"] == "complete" and not d["ok"] for d in sim_log)
    assert any(d["what"] == "complete" and d["stale"] for d in sim_log)  # a copy from before the reset
    assert both.preempted == ["5"]
    assert sorted(both.finished, key=int) == [str(i) for i in range(both.rid)]
    sim_counters = both.sim.core.stats.counters_with_prefix("")
    vllm_counters = both.vllm.core.stats.counters_with_prefix("")
    vllm_counters.pop("engine.hook_seconds", None)  # the connector's wall time per step
    assert sim_counters == vllm_counters
