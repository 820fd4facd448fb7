"""The engine model against hand-computed small cases (tokencake/sim/engine.py, scheduler.py), and
the KV core driven by it in vLLM's call order.

The profile makes the arithmetic easy: a step costs 1 s + 0.01 s per prefill token, blocks hold 4
tokens, the token budget is 8, and decode costs nothing beyond the step.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from tokencake.serving.kvcore.core import KVCore
from tokencake.serving.kvcore.records import Keep
from tokencake.serving.options import Options
from tokencake.sim.engine import Engine, Request, Session
from tokencake.sim.profiles import get_profile

PROFILE = get_profile("cpu-measured").with_(
    name="unit",
    block_size=4,
    max_batched_tokens=8,
    max_num_seqs=8,
    step_s=1.0,
    prefill_s_per_token=0.01,
    attn_s_per_token_ctx=0.0,
    decode_s_per_seq=0.0,
    decode_s_per_ctx_token=0.0,
)


def run(engine: Engine) -> list[Request]:
    done = []
    while engine.has_work():
        done += engine.step()
    return done


def session(name: str, group: str | None = None, prefix: int = 0) -> Session:
    return Session(name, "agent", 4, group, prefix)


def test_one_request_alone() -> None:
    engine = Engine(PROFILE, device_blocks=8)
    req = Request(0, session("a"), prompt_tokens=10, output_tokens=3, arrival=0.0)
    engine.submit(req)
    assert run(engine) == [req]
    # 8 tokens (1.08 s), the last 2 + first token (1.02 s), then 2 decode steps (1 s each).
    assert req.first_token_at == pytest.approx(2.10)
    assert req.finished_at == pytest.approx(4.10)
    assert engine.computed_prompt_tokens == 10 and engine.local_hit_tokens == 0
    # Its 3 full blocks (12 tokens of prompt + output) stay cached after it finished.
    assert len(engine.cache.match(session("a").keys(3))) == 3 and engine.cache.num_free == 8


def test_two_requests_sharing_a_prefix() -> None:
    engine = Engine(PROFILE, device_blocks=8)
    first = Request(0, session("a", "sys", 8), prompt_tokens=9, output_tokens=1, arrival=0.0)
    engine.submit(first)
    run(engine)
    second = Request(1, session("b", "sys", 8), prompt_tokens=13, output_tokens=1, arrival=engine.now)
    engine.submit(second)
    start = engine.now
    run(engine)
    # The 2 shared blocks (8 tokens) hit; the 5 other prompt tokens are computed in one step.
    assert second.local_tokens == 8 and second.computed_prompt_tokens == 5
    assert second.finished_at - start == pytest.approx(1.05)


def test_eviction_takes_the_idle_chain_tail_first() -> None:
    engine = Engine(PROFILE, device_blocks=4)
    a = Request(0, session("a"), prompt_tokens=8, output_tokens=1, arrival=0.0)
    engine.submit(a)
    run(engine)  # 2 full blocks cached, idle
    b = Request(1, session("b"), prompt_tokens=11, output_tokens=1, arrival=engine.now)
    engine.submit(b)
    run(engine)  # needs 3 blocks: the 2 never used, then a's tail
    assert (
        engine.cache.match(session("a").keys(2)) != [] and len(engine.cache.match(session("a").keys(2))) == 1
    )
    again = Request(2, session("a"), prompt_tokens=9, output_tokens=1, arrival=engine.now)
    engine.submit(again)
    run(engine)
    assert again.local_tokens == 4 and again.computed_prompt_tokens == 5


def test_preemption_by_recompute_when_decode_runs_out_of_blocks() -> None:
    engine = Engine(PROFILE, device_blocks=4)
    a = Request(0, session("a"), prompt_tokens=4, output_tokens=6, arrival=0.0)
    b = Request(1, session("b"), prompt_tokens=4, output_tokens=6, arrival=0.0)
    engine.submit(a)
    engine.submit(b)
    done = run(engine)
    assert set(done) == {a, b}
    # Each needs 3 blocks by its last token; 4 blocks hold both only until the decodes grow.
    assert engine.preemptions >= 1 and b.preemptions >= 1 and a.preemptions == 0
    assert engine.computed_prompt_tokens > 8  # b's context was computed again


def test_priority_scheduling_admits_and_preempts_by_priority() -> None:
    engine = Engine(PROFILE, device_blocks=4, scheduling="priority")
    low = Request(0, session("low"), prompt_tokens=4, output_tokens=6, arrival=0.0, priority=5)
    high = Request(1, session("high"), prompt_tokens=4, output_tokens=6, arrival=0.1, priority=0)
    engine.submit(low)
    engine.submit(high)
    assert list(engine.waiting) == [high, low]  # the queue is ordered by priority, then arrival
    done = run(engine)
    assert set(done) == {low, high}
    # When the decodes outgrow 4 blocks the low-priority request is the victim, though it came first.
    assert low.preemptions >= 1 and high.preemptions == 0
    assert high.finished_at < low.finished_at
    with pytest.raises(ValueError, match="scheduling"):
        Engine(PROFILE, scheduling="lifo")


def test_spatial_scheduling_admits_by_the_spatial_score() -> None:
    """The critical path first (priority 0 with an app), then plain requests, then by slack; a
    request that waited longer than the critical path's head start goes first; the victim is
    chosen as under ``priority``."""
    from tokencake.serving.spatial import SpatialWeights

    engine = Engine(PROFILE, device_blocks=4, scheduling="spatial")
    head = SpatialWeights().critical_s
    slack = Request(0, session("slack"), 4, 6, arrival=0.0, priority=20, run_id="app1")
    plain = Request(1, session("plain"), 4, 6, arrival=0.1)
    crit = Request(2, session("crit"), 4, 6, arrival=0.2, priority=0, run_id="app2")
    waited = (head + 30.0) / SpatialWeights().aging  # longer than the head start and the slack
    old = Request(3, session("old"), 4, 6, arrival=-waited, priority=20, run_id="app3")
    for req in (slack, plain, crit, old):
        engine.submit(req)
    assert list(engine.waiting) == [old, crit, plain, slack]
    done = run(engine)
    assert set(done) == {slack, plain, crit, old}
    assert crit.preemptions == 0  # the victims are the high-priority numbers, as vLLM picks them


def test_the_whole_prompt_must_fit_though_only_its_first_chunk_is_scheduled() -> None:
    """vLLM's admission test (``full_sequence_must_fit``): a 20-token prompt needs 5 blocks,
    though its first chunk (8 tokens) takes 2; with 4 free it waits for the running request."""
    engine = Engine(PROFILE, device_blocks=5)
    first = Request(0, session("a"), prompt_tokens=3, output_tokens=3, arrival=0.0)
    big = Request(1, session("b"), prompt_tokens=20, output_tokens=1, arrival=0.0)
    engine.submit(first)
    engine.submit(big)
    engine.step()
    assert engine.running == [first] and list(engine.waiting) == [big]
    run(engine)
    assert big.admitted_at == pytest.approx(first.finished_at)


def test_a_priority_victim_scheduled_earlier_in_the_pass_gives_its_tokens_back() -> None:
    """vLLM's priority preemption: the lowest-priority running request is the victim even when
    it was scheduled earlier in the same pass; it is not computed in that step."""
    engine = Engine(PROFILE, device_blocks=3, scheduling="priority")
    low = Request(0, session("low"), prompt_tokens=3, output_tokens=4, arrival=0.0, priority=5)
    high = Request(1, session("high"), prompt_tokens=4, output_tokens=4, arrival=0.1, priority=0)
    engine.submit(high)
    engine.submit(low)
    engine.step()  # high: 1 block (4 tokens), low: 1 block (3 tokens); 1 free
    engine.step()  # low's decode fits its block; high's needs the last free one
    assert engine.running == [high, low] and engine.cache.num_free == 0
    computed = low.num_computed
    engine.step()  # low is scheduled first (its block has room), then high needs a block: low goes
    assert low.preemptions == 1 and low.num_computed == 0 and computed > 0
    assert engine.running == [high] and list(engine.waiting) == [low]


# ---------------------------------------------------------------- the KV core, driven by the engine
def agent(name: str) -> Session:
    return Session(f"app:{name}", "agent", 4, run_id="app", node=name)


def with_core(scheduling: str = "fcfs", device_blocks: int = 8, **opts: Any) -> Engine:
    options = Options(policy="tokencake", **opts)  # type: ignore[arg-type]
    return Engine(
        PROFILE, device_blocks=device_blocks, options=options, host_blocks=16, scheduling=scheduling
    )


class Recorder(KVCore):
    """The core, logging the hooks the engine calls (and what vLLM guarantees at each)."""

    def __init__(self, *args: Any, calls: list[str], cache: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls, self.cache = calls, cache

    def on_new_request(self, request: Any) -> None:
        self.calls.append(f"new {request.request_id}")
        super().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        self.calls.append(f"match {request.request_id} {num_computed_tokens}")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        self.calls.append(f"alloc {request.request_id} {num_external_tokens}")
        super().update_state_after_alloc(request, block_ids, num_external_tokens)

    def observe_step(self, num_scheduled_tokens: int, now: float | None = None, **kw: Any) -> None:
        self.calls.append(f"step {num_scheduled_tokens} {kw['num_running']}")
        super().observe_step(num_scheduled_tokens, now, **kw)

    def build_jobs(self) -> list:
        jobs = super().build_jobs()
        self.calls.append("jobs " + ",".join(j.kind for j in jobs))
        return jobs

    def request_finished(self, request: Any) -> Any:
        held = all(self.cache.ref[b] > 0 for b in request.blocks)  # its blocks are not freed yet
        self.calls.append(f"finished {request.request_id} {held}")
        return super().request_finished(request)

    def on_worker_meta(self, meta: Any) -> None:
        self.calls.append(f"report {sorted(meta.results)}")
        super().on_worker_meta(meta)


def test_the_engine_calls_the_cores_hooks_in_vllms_order() -> None:
    calls: list[str] = []
    engine = Engine(
        PROFILE,
        device_blocks=8,
        options=Options(policy="offload-all"),
        host_blocks=16,
        core_factory=partial(Recorder, calls=calls, cache=None),
    )
    assert isinstance(engine.core, Recorder)
    engine.core.cache = engine.cache
    req = Request(0, agent("a"), prompt_tokens=9, output_tokens=2, arrival=0.0, run_id="app")
    engine.submit(req)
    run(engine)
    engine.idle_until(engine.now)  # the offload-all save planned at the finish ships
    assert calls == [
        "new 0",
        "match 0 0",
        "alloc 0 0",
        "step 8 1",
        "jobs ",
        "step 1 1",  # the prompt's last token: the first output token
        "jobs ",
        "step 1 1",  # the second
        "jobs ",
        "finished 0 True",  # before its blocks are freed
        "step 0 0",
        "jobs offload",
        "report [1]",  # the copy ran inside the idle step (CPU): reported at its end
    ]


def test_a_session_saved_during_its_tool_is_loaded_back_by_its_next_turn() -> None:
    """End to end on the CPU profile: the request finishes, its tool call starts (an event the
    engine steps for at once), the core offloads the chain under pressure, the next turn misses
    on device and loads it from host inside its step."""
    engine = with_core(usage_threshold=0.0, prefetch=False)
    a = agent("a")
    engine.submit(
        Request(0, a, prompt_tokens=13, output_tokens=1, arrival=0.0, next_tool=("t", 5.0), run_id="app")
    )
    run(engine)
    engine.stall_begin(a, "st1", "t", 5.0)
    assert engine.next_wake() == engine.now  # the event woke the idle engine
    engine.idle_until(engine.now)
    core = engine.core
    assert core is not None and core.stats.counter("offload.blocks") == 3
    engine.cache.release(engine.cache.allocate(engine.cache.num_free))  # the device copies evicted
    engine.idle_until(engine.now + 5.0)
    engine.stall_end(a, "st1", "t", 5.0)
    nxt = Request(1, a, prompt_tokens=17, output_tokens=1, arrival=engine.now, run_id="app")
    engine.submit(nxt)
    start = engine.now
    engine.step()
    assert nxt.host_tokens == 12 and nxt.local_tokens == 0
    load_s = PROFILE.copy_s("h2d", 3)
    assert engine.now - start == pytest.approx(1.0 + 0.01 * 5 + load_s)  # the load is in the step
    assert core.stats.counter("demand_load.requests") == 1


def test_an_idle_engine_steps_when_a_side_stream_copy_finishes() -> None:
    gpu = get_profile("h200-llama3-8b").with_(block_size=4)
    engine = Engine(gpu, device_blocks=8, options=Options(policy="offload-all"), host_blocks=16)
    engine.submit(Request(0, agent("a"), prompt_tokens=9, output_tokens=1, arrival=0.0, run_id="app"))
    run(engine)
    assert engine.next_wake() == engine.now  # the save planned at the finish waits for a step
    engine.idle_until(engine.now)
    done = engine.copies.next_done_at()
    assert done is not None and done > engine.now and engine.next_wake() == done
    engine.idle_until(done)
    assert engine.core is not None and engine.core.stats.counter("offload.blocks") == 2
    assert engine.next_wake() is None


def test_a_step_beside_a_side_stream_copy_lasts_the_measured_slowdown_longer() -> None:
    """On an H200 a forward slowed by up to ~2.4 % while a copy ran beside it (gpu-overlap-*.json)."""
    gpu = get_profile("h200-llama3-8b")
    assert 0.0 < gpu.copy_compute_slowdown < 0.05
    times = []
    for copying in (False, True):
        engine = Engine(gpu, device_blocks=64)
        if copying:
            engine.copies._lane_free_at["d2h"] = 5.0  # a save in flight until t = 5 s
        engine.submit(Request(0, agent("a"), prompt_tokens=100, output_tokens=1, arrival=0.0))
        engine.step()
        times.append(engine.now)
    assert times[1] == pytest.approx(times[0] * (1 + gpu.copy_compute_slowdown))


def test_a_held_chain_yields_to_a_running_request_and_the_pass_admits_none() -> None:
    """vLLM's ``has_pending_block_frees``: a running request finds no free block, the held chain
    is released instead of a preemption, the request allocates next step, and the waiting
    requests are asked (TokenCake's scheduler class: the core's admission control) and skipped,
    none admitted that pass."""
    engine = with_core("spatial", offload=False)
    core = engine.core
    assert core is not None
    running = Request(0, agent("r"), prompt_tokens=4, output_tokens=8, arrival=0.0, run_id="app")
    engine.submit(running)
    engine.step()  # its prompt's block; its first decode token needs a second one
    held = core.pool.allocate(2)  # type: ignore[union-attr]
    core.holds.kept["app:h"] = Keep("app:h", held, until=60.0, since=0.0, rank=1.0, kind="hold")
    others = engine.cache.allocate(engine.cache.num_free)
    late = Request(1, agent("w"), prompt_tokens=3, output_tokens=1, arrival=0.0, run_id="app")
    engine.submit(late)
    engine.step()
    assert engine.preemptions == 0 and not core.holds.kept and engine.cache.num_free == 2
    assert core.stats.counter("hold.yielded_to_running") == 1
    assert core.stats.counter("hold.admission_waits_for_running") == 1 and late.admitted_at is None
    engine.step()
    assert running.generated == 2 and late.admitted_at is not None
    engine.cache.release(others)


def test_a_request_that_must_wait_keeps_its_place_and_the_next_one_is_admitted() -> None:
    """The core's admission control (here: room kept for a due return) skips the request
    for this pass only; vLLM looks at the next one, and the skipped one stays first in line
    (TokenCake's scheduler class: the core's admission control)."""
    engine = with_core("spatial", offload=False)
    core = engine.core
    assert core is not None
    core.admission.reserve_returns = lambda now: {"app:x": 5}  # type: ignore[method-assign]
    core.reserves_returns = True
    running = Request(0, agent("r"), prompt_tokens=4, output_tokens=8, arrival=0.0, run_id="app")
    engine.submit(running)
    engine.step()
    big = Request(1, agent("big"), prompt_tokens=12, output_tokens=1, arrival=0.0, run_id="app")
    small = Request(2, agent("small"), prompt_tokens=3, output_tokens=1, arrival=0.0, run_id="app")
    engine.submit(big)
    engine.submit(small)
    engine.step()
    assert small.admitted_at is not None and big.admitted_at is None
    assert list(engine.waiting) == [big] and core.stats.counter("return_reserve.denials") == 1


def test_the_eviction_side_and_the_admission_order_follow_the_scheduler() -> None:
    """As the connector's spatial scheduler: critical-last eviction goes with the spatial queue
    (unless ``critical_last`` is off), and the queue orders by the KV policy's admission (or the
    configured one)."""
    from tokencake.serving.spatial import SpatialWeights, admission_weights

    assert with_core("spatial").core.critical_last  # type: ignore[union-attr]
    assert not with_core("priority").core.critical_last  # type: ignore[union-attr]
    assert not with_core("spatial", critical_last=False).core.critical_last  # type: ignore[union-attr]
    assert Engine(PROFILE, scheduling="spatial").scorer.weights == SpatialWeights()
    assert with_core("spatial").scorer.weights == SpatialWeights()
    continuum = Engine(PROFILE, options=Options(policy="continuum"), scheduling="spatial")
    assert continuum.scorer.weights == admission_weights("continuum")
    chosen = with_core("spatial", admission="apps-side-by-side")
    assert chosen.scorer.weights == admission_weights("apps-side-by-side")


def test_a_request_reads_as_the_cores_request_view() -> None:
    s = Session("app:w", "worker", 4, run_id="app", node="w")
    req = Request(
        7,
        s,
        prompt_tokens=9,
        output_tokens=3,
        arrival=0.0,
        next_tool=("search", 2.0),
        priority=3,
        run_id="app",
    )
    req.generated, req.num_computed = 2, 10
    assert (req.request_id, req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == ("7", 11, 9, 2)
    assert req.num_computed_tokens == 10 and req.block_hashes == s.keys(2)
    meta = req.kv_transfer_params["tokencake"]  # type: ignore[index]
    assert (meta["session_id"], meta["run_id"], meta["node"], meta["agent_type"]) == (
        "app:w",
        "app",
        "w",
        "worker",
    )
    assert meta["next_stall"]["tool"] == "search" and meta["next_stall"]["predicted_s"] == 2.0
    assert meta["graph"]["on_critical_path"] is False and meta["graph"]["slack_s"] == 3.0
    assert Request(8, s, 9, 3, arrival=0.0).kv_transfer_params is None  # a plain request
