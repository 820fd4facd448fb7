"""Trace files and validation (tokencake/sim/trace.py) and the preset traces (presets.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokencake.agents import RunResult
from tokencake.agents._result import NodeResult, RunEvent
from tokencake.sim.presets import from_bench_point, generate
from tokencake.sim.stored import FIXTURES, read_results
from tokencake.sim.trace import AppTrace, DelayStep, LLMStep, NodeTrace, ToolStep, Trace, TraceError


def small() -> Trace:
    worker = NodeTrace(
        "w", (DelayStep(0.5), LLMStep(100, 8), ToolStep("t", 2.0, 3.5), LLMStep(130, 8)), "worker"
    )
    join = NodeTrace("j", (LLMStep(40, 8),), "join", ("w",), "sys", 16)
    return Trace((AppTrace("r0", 1.5, (worker, join)),), {"note": "unit"})


def test_jsonl_round_trip(tmp_path: Path) -> None:
    path = small().write_jsonl(tmp_path / "t.jsonl")
    header = json.loads(path.read_text().splitlines()[0])
    assert header == {"type": "trace", "version": 1, "note": "unit"}
    back = Trace.read_jsonl(path)
    assert back == small() and back.num_sessions == 2 and back.num_llm_calls == 3


@pytest.mark.parametrize(
    ("nodes", "needle"),
    [
        (
            (
                NodeTrace("a", (LLMStep(10, 1),), after=("b",)),
                NodeTrace("b", (LLMStep(10, 1),), after=("a",)),
            ),
            "cycle",
        ),
        ((NodeTrace("a", (LLMStep(10, 1),), after=("x",)),), "unknown node"),
        ((NodeTrace("a", (LLMStep(50, 1), LLMStep(40, 1))),), "only grows"),
        ((NodeTrace("a", (ToolStep("t", 1.0, float("nan")),)),), "finite"),
        ((NodeTrace("a", (LLMStep(0, 1),)),), "tokens >= 1"),
    ],
)
def test_a_trace_the_simulator_cannot_replay_is_refused(nodes: tuple, needle: str) -> None:
    with pytest.raises(TraceError, match=needle):
        Trace((AppTrace("r", 0.0, nodes),))


def test_a_bad_file_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"type": "trace", "version": 1}\n{"type": "app", "run_id": "r"}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2"):
        Trace.read_jsonl(path)


def test_a_real_run_becomes_a_trace() -> None:
    ev = [
        RunEvent("node_started", "w", 10.0),
        RunEvent("llm_started", "w", 10.8),
        RunEvent("llm_finished", "w", 12.0, {"prompt_tokens": 300, "completion_tokens": 20}),
        RunEvent("tool_started", "w", 12.0, {"tool": "search", "predicted_s": 3.0}),
        RunEvent("tool_finished", "w", 16.1, {"duration_s": 4.1}),
        RunEvent("llm_started", "w", 16.1),
        RunEvent("llm_finished", "w", 17.0, {"prompt_tokens": 350, "completion_tokens": 20}),
    ]
    result = RunResult("run-1", "app", {"w": NodeResult("w", status="ok")}, ["w"], events=ev)
    (app,) = Trace.from_runs([(2.0, result)]).apps
    assert app.arrival_s == 2.0
    (node,) = app.nodes
    assert node.steps == (DelayStep(0.8), LLMStep(300, 20), ToolStep("search", 3.0, 4.1), LLMStep(350, 20))


def test_a_stored_bench_point_is_rebuilt_with_its_measured_tokens() -> None:
    results = read_results(FIXTURES["stress"].path)  # policies-stress-results.json, compact
    point = results["points"][0]
    trace = from_bench_point(point)
    (app,) = trace.apps
    names = [n.name for n in app.nodes]
    assert names[-1] == "join" and set(app.nodes[-1].after) == set(names[:-1])
    calls = [c for c in point["systems"]["baseline"]["calls"] if c["node"] == "worker_1"]
    w1 = app.nodes[1]
    assert [s.prompt_tokens for s in w1.steps if isinstance(s, LLMStep)] == [
        c["prompt_tokens"] for c in sorted(calls, key=lambda c: c["started"])
    ]
    assert isinstance(w1.steps[0], DelayStep) and w1.steps[0].seconds == pytest.approx(0.8)
    tools = [s for s in w1.steps if isinstance(s, ToolStep)]
    assert {t.tool for t in tools} == {"lookup", "crawl"}
    assert {t.predicted_s for t in tools} == {3.0, 1.5}  # crawl's hint is 2x too small


def test_generated_presets_scale() -> None:
    trace = generate("stress", agents=20, turns=4, context_tokens=8000)
    assert len(trace.apps) == 3 and trace.num_sessions == 20 + 3  # 8 + 6 + 6 workers, 3 joins
    first = trace.apps[0].nodes[0]
    assert first.steps[0].prompt_tokens > 4000 and sum(isinstance(s, LLMStep) for s in first.steps) == 4
    assert [a.arrival_s for a in trace.apps] == sorted(a.arrival_s for a in trace.apps)
    ci = generate("ci", agents=3)
    assert len(ci.apps) == 3 and all(a.arrival_s == 0 for a in ci.apps)
    with pytest.raises(ValueError, match="unknown preset"):
        generate("nope")
    with pytest.raises(ValueError, match="agents"):
        generate("stress", agents=0)


def test_generated_stress_takes_agent_mix_overrides() -> None:
    trace = generate(
        "stress",
        agents=4,
        mix={"tool_median_s": 10.0, "tool_sigma": 0.0, "hint_error": 0.5, "turns": [2, 2], "stagger_s": 0.0},
    )
    worker = trace.apps[0].nodes[0]
    tools = [s for s in worker.steps if isinstance(s, ToolStep)]
    assert len(tools) == 1 and tools[0].actual_s == pytest.approx(10.0)  # sigma 0: every call the median
    hints = {t.predicted_s for n in trace.apps[0].nodes for t in n.steps if isinstance(t, ToolStep)}
    assert hints == {10.0, 20.0}  # crawl's hint 2x too large
    assert not any(isinstance(s, DelayStep) for n in trace.apps[0].nodes for s in n.steps)
    with pytest.raises(ValueError, match="stress preset"):
        generate("ci", mix={"tool_sigma": 1.0})
    with pytest.raises(ValueError, match="cannot override seed"):
        generate("stress", mix={"seed": 3})
    with pytest.raises(ValueError, match="unknown parameter"):
        generate("stress", mix={"tool_sigm": 1.0})


def test_priorities_follow_the_critical_path_as_the_sdk_computes_them(tmp_path: Path) -> None:
    from tokencake.sim.trace import with_priorities

    long = NodeTrace("long", (LLMStep(10, 50), ToolStep("t", 20.0, 1.0), LLMStep(80, 50)))
    short = NodeTrace("short", (LLMStep(10, 50), ToolStep("t", 5.0, 1.0), LLMStep(80, 50)))
    join = NodeTrace("join", (LLMStep(10, 50),), after=("long", "short"))
    app = with_priorities(AppTrace("r", 0.0, (long, short, join)))
    prio = {n.name: n.priority for n in app.nodes}
    assert prio == {"long": 0, "join": 0, "short": 15}  # slack 20 - 5 s
    trace = Trace((app,))
    assert Trace.read_jsonl(trace.write_jsonl(tmp_path / "p.jsonl")) == trace
