"""Whole simulations: the closed loop, the DAG, and every policy on a pressured trace (run.py)."""

from __future__ import annotations

import pytest

from tokencake.sim import SYSTEMS, AppTrace, LLMStep, NodeTrace, ToolStep, Trace, get_profile, simulate
from tokencake.sim.presets import generate

CPU = get_profile("cpu-measured")


@pytest.fixture(scope="module")
def pressured() -> Trace:
    """Stress-shaped: 6 workers with ~1,300-2,600-token contexts on 40 blocks of 128 tokens."""
    return generate("stress", agents=6, turns=4)


def test_every_system_finishes_every_app_deterministically(pressured: Trace) -> None:
    results = {name: simulate(pressured, CPU, name) for name in SYSTEMS}
    for name, r in results.items():
        assert len(r.app_e2e_s) == len(pressured.apps), name
        assert r.llm_calls == pressured.num_llm_calls, name
    again = simulate(pressured, CPU, "tokencake")
    assert again.app_e2e_s == results["tokencake"].app_e2e_s
    ideal, base, tc = results["ideal"], results["baseline"], results["tokencake"]
    assert ideal.preemptions == 0 and ideal.device_blocks > base.device_blocks
    assert ideal.e2e_mean_s < base.e2e_mean_s  # the trace is under pressure
    # A host tier recomputes less than stock vLLM, and TokenCake gets most of the ideal's gain.
    assert tc.computed_prompt_tokens < base.computed_prompt_tokens
    assert tc.host_hit_tokens > 0 and tc.e2e_mean_s < base.e2e_mean_s
    ext = tc.extension
    assert ext is not None and ext["counters"]["offload.blocks"] > 0
    assert results["baseline"].extension is None


def test_a_join_starts_after_its_workers_and_a_session_waits_for_its_tool() -> None:
    w = NodeTrace("w", (LLMStep(200, 4), ToolStep("t", 5.0, 5.0), LLMStep(260, 4)), "worker")
    j = NodeTrace("j", (LLMStep(50, 4),), "join", ("w",))
    trace = Trace((AppTrace("r", 2.0, (w, j)),))
    r = simulate(trace, CPU, "baseline")
    (e2e,) = r.app_e2e_s
    # Three calls in sequence plus the 5 s tool: more than the tool alone, less than a minute.
    assert 5.0 < e2e < 60.0
    assert r.makespan_s == pytest.approx(2.0 + e2e)


def test_the_same_trace_on_a_gpu_profile_runs_at_scale() -> None:
    trace = generate("stress", agents=40, turns=3, context_tokens=4000)
    prof = get_profile("h200-llama3-8b")
    small = prof.with_(device_blocks=2000)  # 32k tokens of KV: 40 agents do not fit
    base = simulate(trace, small, "baseline")
    tc = simulate(trace, small, "tokencake")
    ideal = simulate(trace, small, "ideal")
    assert ideal.e2e_mean_s <= tc.e2e_mean_s <= base.e2e_mean_s
    assert tc.computed_prompt_tokens < base.computed_prompt_tokens


def test_the_spatial_ablations_are_the_spatial_scheduler_with_one_option_changed() -> None:
    assert SYSTEMS["spatial-order"].options == {"critical_last": False}
    assert SYSTEMS["reserve-off"].engine_scheduling() == "spatial"
    assert SYSTEMS["spare-late"].options == {"critical_spare_late": True}
    assert SYSTEMS["spare-late"].engine_scheduling() == "spatial"
    assert SYSTEMS["spatial-off"].engine_scheduling() == "priority"
