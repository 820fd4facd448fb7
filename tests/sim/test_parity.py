"""Scripted traces drive the KV core through both backends, and their decision logs agree.

(a) vLLM 0.32's own ``Scheduler`` with the TokenCake connector (no model: each scheduled request
samples one token per step), stepped with ``schedule`` / ``update_from_output``; (b) the
simulator's engine. Both cores are built alike (``tokencake.sim.kv.build_core``; on the vLLM side
as ``SchedulerSide`` bound to vLLM's ``BlockPool``), on one clock, and both record their
decisions (``KVCore.decisions``); the test adds the admission counters to each log where they
are counted (:func:`log_admission_reasons`: why a request waits). The engines are stepped in
lockstep and must schedule the same requests; :func:`check_parity` then compares the logs and
the counters.

The first trace runs vLLM's own scheduler class (FCFS, no admission control) against the
simulator's ``fcfs`` engine: requests with prompts and block hashes (vLLM's requests hash their
blocks with the simulator's keys), stall begin and end events, copy completions (a failed
prefetch, an offload whose report comes past its timeout), a preemption, a hold and its release,
waits for a prefetch, demand loads and a prefix-cache reset. The others run TokenCake's
``--scheduler-cls`` (``SpatialScheduler``, its queue and admission control wired to the test's
core and clock) against the simulator's ``spatial`` engine, with room kept ahead of returns
(``return_reserve``) and a critical-path agent: admission control holds requests back for kept
room, behind a running request that held chains gave their blocks to, for the critical reserve
and for an idle critical chain, and lets requests go on past their bound.

What the engine model must match for the two to schedule the same things, and what the traces
keep to: the block size, the token budget and ``max_num_seqs``; no watermark, no lookahead slots;
prompts of at most one chunk (every scheduled request samples a token); FCFS order, or the
spatial score on one clock under vLLM's ``priority`` policy (the preemption victim the engine
models) with every arrival after time 0 (vLLM's queue counts no wait of a request that arrived
at 0); vLLM's pool has one block more (its null block, id 0), so its block ids are the
simulator's plus one. The test plays vLLM's worker with the simulator's copy engine (CPU
backend: copies run inside their step) and the same script of failed and late reports.

:func:`test_a_decision_changed_by_hand_fails_the_parity_check` changes one decision of one
backend's core and checks that the comparison catches it.
:func:`test_a_request_held_back_past_its_slack_is_queued_alike` holds requests back until they
have spent their slack: both queues count a wait at every pop (a skip included) and key a request
again when it is put back.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
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
from tokencake.serving.kvcore.core import KVCore
from tokencake.serving.kvcore.wire import CopyJob
from tokencake.serving.model import default_model_dir
from tokencake.serving.options import Options
from tokencake.serving.spatial import SpatialScorer, admission_weights
from tokencake.serving.vllm.metadata import TokenCakeWorkerMeta
from tokencake.serving.vllm.scheduler import SpatialScheduler
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


class ScriptedCopies(CopyEngine):
    """The simulator's copy engine with a script: jobs that fail, and jobs reported only at a
    given time (``hold``: by job id)."""

    def __init__(self, fail: frozenset[int], hold: dict[int, float]) -> None:
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


#: One step as both engines report it: (request, tokens) in the order scheduled, preempted,
#: finished.
Step = tuple[list[tuple[str, int]], list[str], list[str]]


class ParityError(AssertionError):
    """The backends scheduled differently, or their decisions or counters differ."""


def log_admission_reasons(core: KVCore) -> None:
    """Each admission counter the core counts (a pass a request is held back, by reason; one it
    goes on past its bound) joins its decision log where it is counted, as ``{"what":
    "admission", "counter": ...}``: the log's ``wait`` says only that a request waits."""
    inc = core.stats.inc

    def counted(name: str, n: float = 1) -> None:
        inc(name, n)
        if name.startswith(("admission.held_back.", "admission.past_bound.")):
            core.note("admission", counter=name.removeprefix("admission."))

    core.stats.inc = counted  # type: ignore[method-assign]


# ---------------------------------------------------------------- the two backends
class SimBackend:
    def __init__(self, trace: Trace) -> None:
        self.engine = Engine(
            PROFILE,
            options=Options(**trace.options),
            copies=ScriptedCopies(trace.fail, trace.hold),
            scheduling="spatial" if trace.spatial else "fcfs",
        )
        assert self.engine.core is not None
        self.core = self.engine.core
        self.core.decisions = []
        log_admission_reasons(self.core)
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
        scheduled = [(r.request_id, n) for r, n in plan.scheduled]
        preempted = sorted(r.request_id for r in plan.preempted)
        return start, self.engine.now, (scheduled, preempted, sorted(r.request_id for r in finished))

    def reset(self) -> bool:
        return self.engine.reset_prefix_cache()


class VllmBackend:
    def __init__(self, scheduler: Scheduler, trace: Trace) -> None:
        self.scheduler = scheduler
        self.t = 0.0
        options = Options(**trace.options)
        side = build_core(
            PROFILE,
            options,
            host_blocks=HOST,
            clock=lambda: self.t,
            critical_last=trace.spatial and options.critical_last,
            factory=SchedulerSide,
        )
        side.bind_pool(scheduler.kv_cache_manager.block_pool)
        side.decisions = []
        log_admission_reasons(side)
        conn: Any = scheduler.connector
        conn.sched = side  # the connector's hooks now reach this core
        if trace.spatial:
            # TokenCake's scheduler class wired its queue and admission control to the
            # connector's own core at start-up: wire them to this one, on this clock.
            assert getattr(scheduler, "_tokencake_admit", None) is not None
            side.enable_admission_control(scheduler._running_need)  # type: ignore[attr-defined]
            queue: Any = scheduler.waiting
            queue.scorer = SpatialScorer(admission_weights(options.admission or side.policy.admission))
            queue.clock, queue.retained, queue.saved = (lambda: self.t), side.holds_kv, side.saved_kv
        self.core = side
        self.copies = ScriptedCopies(trace.fail, trace.hold)  # the worker

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
            arrival_time=req.arrival,
            priority=req.priority,
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
        return list(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids), finished

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


# ---------------------------------------------------------------- driving both
class Both:
    """Every action on both backends, in lockstep on one clock (the simulator's step times)."""

    def __init__(self, scheduler: Scheduler, trace: Trace) -> None:
        self.sim, self.vllm = SimBackend(trace), VllmBackend(scheduler, trace)
        self.rid = 0
        self.preempted: list[str] = []
        self.finished: list[str] = []
        #: Request id -> the start of the first step that scheduled it.
        self.started: dict[str, float] = {}

    def now(self) -> float:
        return self.sim.engine.now

    def at(self, t: float) -> None:
        assert t >= self.now()
        self.sim.at(t)
        self.vllm.at(t)

    def submit(
        self,
        session: Session,
        prompt: int,
        out: int,
        tool: tuple[str, float] | None = None,
        *,
        slack: int = 0,
    ) -> str:
        """A request of ``session``; ``slack``: its node's slack in seconds (0: on the critical path)."""
        req = Request(self.rid, session, prompt, out, self.now(), tool, priority=slack, run_id=session.run_id)
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
            got = self.vllm.step(start, end)
            if got != step:
                raise ParityError(f"the engines scheduled differently at {start} s: sim {step}, vLLM {got}")
            for req_id, _n in step[0]:
                self.started.setdefault(req_id, start)
            self.preempted += step[1]
            self.finished += step[2]

    def until(self, t: float) -> None:
        """Step while there is work, then idle to ``t`` and step once (the core's wake-up)."""
        while self.sim.engine.has_work() and self.now() < t:
            self.step()
        if self.now() < t:
            self.at(t)
            self.step()


def check_parity(both: Both) -> list[dict[str, Any]]:
    """The two cores made the same decisions, in the same order, and count the same; returns
    the (simulator's) decision log. :class:`ParityError` names the first difference."""
    sim_log = normalized(both.sim.core.decisions or [], 0)
    vllm_log = normalized(both.vllm.core.decisions or [], 1)
    for i, (s, v) in enumerate(zip(sim_log, vllm_log, strict=False)):
        if s != v:
            raise ParityError(f"decision {i} differs: sim {s}, vLLM {v}")
    if len(sim_log) != len(vllm_log):
        raise ParityError(f"{len(sim_log)} decisions in the simulator, {len(vllm_log)} in vLLM")
    sim_counters = both.sim.core.stats.counters_with_prefix("")
    vllm_counters = both.vllm.core.stats.counters_with_prefix("")
    vllm_counters.pop("engine.hook_seconds", None)  # the connector's wall time per step
    if sim_counters != vllm_counters:
        diff = {
            k: (sim_counters.get(k), vllm_counters.get(k))
            for k in sorted(sim_counters.keys() | vllm_counters.keys())
            if sim_counters.get(k) != vllm_counters.get(k)
        }
        raise ParityError(f"the counters differ (sim, vLLM): {diff}")
    return sim_log


def agent(name: str) -> Session:
    return Session(f"run:{name}", "worker", BS, run_id="run", node=name)


# ---------------------------------------------------------------- the traces
@dataclass(frozen=True)
class Trace:
    """A script and what both backends are built with for it."""

    play: Callable[[Both], None]
    #: The connector's options (``Options``).
    options: dict[str, Any]
    #: TokenCake's scheduler class in vLLM and the simulator's ``spatial`` engine (else vLLM's own
    #: scheduler class and ``fcfs``).
    spatial: bool = False
    #: Job ids the script fails or reports late (the same ids on both sides: the cores agree).
    fail: frozenset[int] = frozenset()
    hold: dict[int, float] = field(default_factory=dict)


def play_copies(both: Both) -> None:
    """Copies, holds, prefetch waits, demand loads, a preemption and a reset (vLLM's scheduler)."""
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


COPIES = Trace(
    play_copies,
    {"policy": "tokencake", "usage_threshold": 0.0, "job_timeout_s": 3.0},
    fail=frozenset({6}),
    hold={2: 14.0, 6: 11.2},
)


def play_admission(both: Both) -> None:
    """Admission control (TokenCake's scheduler class): each reason to hold a request back."""
    both.at(1.0)  # (vLLM's queue counts no wait of a request that arrived at 0)
    k, a, b = agent("k"), agent("a"), agent("b")
    both.submit(k, 48, 2, ("search", 10.0))  # on the critical path
    both.submit(a, 48, 2, ("fetch", 20.0), slack=30)
    both.step(2)  # both finish; their chains are saved at once
    both.begin(k, "st-k", "search", 10.0)
    both.begin(a, "st-a", "fetch", 20.0)
    both.step()
    both.submit(Session("p", "", BS), 112, 40)  # a long plain request takes most of the device
    both.step()
    # w's blocks would evict k's idle chain: it waits (critical_chain) until its slack is spent.
    both.submit(agent("w"), 32, 2, slack=3)
    both.until(12.0)  # k's chain is prefetched and held
    # n fits only with k's held chain lent (the critical reserve): it waits (critical_reserve)
    # until p's next block takes the last free one and the hold yields. Room is kept for k's and
    # a's returns by then; n is past its bound (admission_wait_s): it goes on, the room lent.
    both.submit(agent("n"), 32, 2, slack=30)
    both.until(25.0)
    # x does not fit beside the room kept for a's return: it waits (return_reserve) its bound.
    both.submit(agent("x"), 16, 2, slack=30)
    both.until(45.0)
    both.end(k, "st-k", "search", 42.0)
    both.end(a, "st-a", "fetch", 42.0)
    both.submit(k, 60, 2)
    both.submit(a, 60, 2, slack=30)
    both.until(50.0)
    # A hold yields to a running request: b's chain is saved ("lookup": a tool with no history,
    # so the prefetch falls due at the prior's time) ...
    both.submit(b, 48, 2, ("lookup", 8.0), slack=30)
    both.step(2)
    both.begin(b, "st-b", "lookup", 8.0)
    both.step()
    both.submit(Session("r", "", BS), 24, 12)  # ... r takes an empty block and b's tail ...
    both.until(57.0)  # ... b's prefetch brings the tail back (job 11, reported a step late) ...
    both.submit(Session("q", "", BS), 112, 3)  # ... q takes the free blocks but b's idle head ...
    both.step()  # ... and the report: b's hold takes the head, the last free blocks.
    # q's first decode finds no free block: the hold yields to it, and v waits (running), then
    # for the room kept for b's return.
    both.submit(agent("v"), 16, 2, slack=30)
    both.until(62.0)
    both.end(b, "st-b", "lookup", 12.0)
    both.submit(b, 60, 2, slack=30)
    both.until(70.0)


ADMISSION = Trace(
    play_admission,
    {"policy": "tokencake", "usage_threshold": 0.0, "return_reserve": "on", "admission_wait_s": 4.0},
    spatial=True,
    hold={11: 57.5},
)


def play_slack_spent(both: Both) -> None:
    """Two non-critical requests wait for the room kept for a's return, the first past its slack;
    once a's tool returns there is room for both, admitted in queue order."""
    both.at(1.0)
    a = agent("a")
    both.submit(a, 48, 2, ("fetch", 10.0), slack=30)
    both.step(2)
    both.begin(a, "st-a", "fetch", 10.0)
    both.step()
    both.submit(Session("p", "", BS), 144, 30)
    both.until(10.0)
    both.submit(agent("r1"), 16, 2, slack=5)
    both.step(2)
    both.submit(agent("r2"), 16, 2, slack=2)
    both.step(4)  # r1 has waited 6 s: past its slack
    both.end(a, "st-a", "fetch", 16.0)
    both.until(40.0)  # both admitted at 17 s; at their first decode one is preempted


SLACK_SPENT = Trace(
    play_slack_spent,
    {"policy": "tokencake", "usage_threshold": 0.0, "return_reserve": "on", "admission_wait_s": 20.0},
    spatial=True,
)


# ---------------------------------------------------------------- vLLM's schedulers
def vllm_config(policy: str) -> VllmConfig:
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
            max_num_batched_tokens=BUDGET,
            max_num_seqs=16,
            max_model_len=1024,
            is_encoder_decoder=False,
            policy=policy,
        ),
        kv_transfer_config=kvt,
    )


def make_scheduler(trace: Trace) -> Scheduler:
    """vLLM's ``Scheduler`` (FCFS), or TokenCake's ``SpatialScheduler`` under vLLM's ``priority``
    policy (what ``tokencake serve`` runs) for a trace with ``spatial``."""
    config = vllm_config("priority" if trace.spatial else "fcfs")
    kv = KVCacheConfig(
        num_blocks=BLOCKS + 1,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["l0"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32)
            )
        ],
    )
    cls = SpatialScheduler if trace.spatial else Scheduler
    return cls(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BS,
        log_stats=False,
    )


@pytest.fixture
def run() -> Iterator[Callable[[Trace], Both]]:
    """Builds both backends for a trace (its script not played yet); shuts vLLM's connector down."""
    made: list[Scheduler] = []

    def build(trace: Trace) -> Both:
        made.append(make_scheduler(trace))
        return Both(made[-1], trace)

    yield build
    for sched in made:
        sched.connector.shutdown()  # type: ignore[union-attr]


# ---------------------------------------------------------------- the tests
def test_the_simulator_and_vllm_drive_the_core_to_the_same_decisions(run: Callable[[Trace], Both]) -> None:
    both = run(COPIES)
    COPIES.play(both)
    log = check_parity(both)
    # The trace reaches every kind of decision it is meant to.
    whats = {d["what"] for d in log}
    assert whats >= {"job", "hold", "release", "wait", "complete", "commit", "publish", "timeout", "reset"}
    kinds = {d["kind"] for d in log if d["what"] == "job"}
    assert kinds == {"offload", "prefetch", "load"}
    assert any(d["what"] == "complete" and not d["ok"] for d in log)
    assert any(d["what"] == "complete" and d["stale"] for d in log)  # a copy from before the reset
    assert both.preempted == ["5"]
    assert sorted(both.finished, key=int) == [str(i) for i in range(both.rid)]


def test_admission_control_drives_the_core_to_the_same_decisions(run: Callable[[Trace], Both]) -> None:
    both = run(ADMISSION)
    ADMISSION.play(both)
    log = check_parity(both)
    # The trace reaches every kind of admission wait, and a request goes on past its bound.
    assert {d["why"] for d in log if d["what"] == "wait"} >= {"room", "running"}
    counted = {d["counter"] for d in log if d["what"] == "admission"}
    assert counted >= {
        "held_back.return_reserve",
        "held_back.running",
        "held_back.critical_reserve",
        "held_back.critical_chain",
        "past_bound.return_reserve",
    }
    past_bound = {d["t"] for d in log if d["what"] == "admission" and d["counter"].startswith("past_bound.")}
    assert past_bound & set(both.started.values())  # admitted in a pass it was past its bound
    assert any(d["what"] == "release" and d["why"] == "running" for d in log)
    assert sorted(both.finished, key=int) == [str(i) for i in range(both.rid)]


def test_a_request_held_back_past_its_slack_is_queued_alike(run: Callable[[Trace], Both]) -> None:
    both = run(SLACK_SPENT)
    SLACK_SPENT.play(both)
    check_parity(both)
    # r1 (request 2) waited past its slack while held back: it goes ahead of r2 (request 3, less
    # slack, submitted later) as critical.
    plan = next(p for p in both.sim.plans if any(r.request_id == "3" for r, _n in p.scheduled))
    order = [r.request_id for r, _n in plan.scheduled]
    assert order.index("2") < order.index("3")
    assert sorted(both.finished, key=int) == [str(i) for i in range(both.rid)]


# ---------------------------------------------------------------- a decision changed by hand
#: Changes one decision of a core (on its instance or a component's), and lists each time the
#: change made a decision differ from the one the core would have made.
Mutation = Callable[[KVCore, pytest.MonkeyPatch], list[str]]


def admit_what_it_holds_back(core: KVCore, mp: pytest.MonkeyPatch) -> list[str]:
    """Admission: every request the core would have held back goes on."""
    changed: list[str] = []
    admit = core.admission.admit

    def admits(request: Any, num_running: int) -> bool:
        if not admit(request, num_running):
            changed.append(request.request_id)
        return True

    mp.setattr(core.admission, "admit", admits)
    return changed


def skip_the_first_hold(core: KVCore, mp: pytest.MonkeyPatch) -> list[str]:
    """Holds: the first prefetched chain is not held."""
    changed: list[str] = []
    keep = core.holds.keep

    def keeps(session_id: str, chain: list, until: float, now: float, **kw: Any) -> None:
        if kw.get("kind") == "hold" and not changed:
            changed.append(session_id)
            return
        keep(session_id, chain, until, now, **kw)

    mp.setattr(core.holds, "keep", keeps)
    return changed


def drop_the_first_offload(core: KVCore, mp: pytest.MonkeyPatch) -> list[str]:
    """Copy jobs: the first offload that would copy blocks is not planned."""
    changed: list[str] = []
    plan = core.offload.plan_offload

    def plans(chain: list, **kw: Any) -> Any:
        copies = any(
            slot is None and dev is not None and h not in core.copies.filling for _i, h, dev, slot in chain
        )
        if copies and not changed:
            changed.append(kw["session_id"])
            return None
        return plan(chain, **kw)

    mp.setattr(core.offload, "plan_offload", plans)
    return changed


def prefetch_the_first_stall_at_its_end(core: KVCore, mp: pytest.MonkeyPatch) -> list[str]:
    """Copy jobs: the first offloaded stall is brought back when its tool returns, not before."""
    changed: list[str] = []
    on_stall = core.policy.on_stall

    def decides(view: Any) -> Any:
        plan = on_stall(view)
        if plan.action == "offload" and plan.prefetch == "predictive" and not changed:
            changed.append(view.session_id)
            return replace(plan, prefetch="at_end")
        return plan

    mp.setattr(core.policy, "on_stall", decides)
    return changed


MUTATIONS: dict[str, tuple[str, Mutation]] = {
    "sim-admits-what-it-holds-back": ("sim", admit_what_it_holds_back),
    "vllm-skips-a-hold": ("vllm", skip_the_first_hold),
    "sim-drops-an-offload": ("sim", drop_the_first_offload),
    "vllm-prefetches-at-the-end": ("vllm", prefetch_the_first_stall_at_its_end),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_a_decision_changed_by_hand_fails_the_parity_check(
    run: Callable[[Trace], Both], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    backend, mutation = MUTATIONS[name]
    both = run(ADMISSION)
    changed = mutation(getattr(both, backend).core, monkeypatch)
    with pytest.raises(ParityError):
        ADMISSION.play(both)
        check_parity(both)
    assert changed, "the change made no decision differ"
