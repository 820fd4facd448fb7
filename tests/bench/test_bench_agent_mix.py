"""The fan-in ``agent_mix`` app: shape, seeded heterogeneity, tool-time distribution, hints, shared prefix."""

import itertools
import math
import statistics
import time

import pytest

import tokencake as tc
from tokencake.bench.agent_mix import (
    JOIN_TYPE,
    WORKER_TYPE,
    AgentMixSpec,
    build_app,
    hints,
    plan,
    preamble,
    system_prompt,
    tool_durations,
    tool_for,
)

#: Fast enough for an offline run: near-zero tools and start delays.
TINY = dict(workers=3, turns=(2, 4), context_tokens=40, max_tokens=6, tool_median_s=0.01, stagger_s=0.05)


def _common_prefix(texts: list[str]) -> str:
    """The longest string every text starts with."""
    first, last = min(texts), max(texts)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]


def _run(spec, run_id="r1", replies=None):
    """Run the app on a scripted model; returns (result, requests, first request time per node and
    ``"<start>"``: when the run began)."""
    first: dict[str, float] = {}

    def reply(req):
        first.setdefault(req.node, time.monotonic())
        return replies(req) if replies else f"{req.node} says {req.turn}"

    llm = tc.ScriptedLLM(reply)
    first["<start>"] = time.monotonic()
    result = build_app(spec).run_sync(llm=llm, run_id=run_id)
    return result, llm.requests, first


def test_dag_fans_in_every_worker_to_one_join():
    app = build_app(AgentMixSpec(workers=4, seed=1))
    graph = app.graph
    workers = [f"worker_{i}" for i in range(4)]
    assert set(graph.nodes) == {*workers, "join"}
    assert sorted(graph.predecessors("join")) == workers
    assert all(not list(graph.predecessors(w)) for w in workers)
    assert app.sinks == ["join"]
    assert {app.nodes[w].agent_type for w in workers} == {WORKER_TYPE}
    assert app.nodes["join"].agent_type == JOIN_TYPE


def test_plan_is_seeded_and_heterogeneous():
    spec = AgentMixSpec(workers=40, turns=(3, 5), context_tokens=1000, stagger_s=0.8, seed=4)
    workers = plan(spec)
    assert workers == plan(AgentMixSpec(workers=40, turns=(3, 5), context_tokens=1000, stagger_s=0.8, seed=4))
    assert workers != plan(AgentMixSpec(workers=40, turns=(3, 5), context_tokens=1000, seed=5))
    assert {w.turns for w in workers} == {3, 4, 5}
    lengths = [w.private_tokens for w in workers]
    assert all(500 <= n <= 1500 for n in lengths)
    assert max(lengths) - min(lengths) > 500  # spread over the range, not clustered
    assert [w.start_s for w in workers] == pytest.approx([0.8 * i for i in range(40)])
    assert [w.start_s for w in plan(spec, 0.5)] == pytest.approx([0.4 * i for i in range(40)])


def test_tool_durations_are_seeded_lognormal_and_capped():
    spec = AgentMixSpec(workers=500, turns=(5, 5), tool_median_s=3.0, tool_sigma=0.6, seed=2)
    d = tool_durations(spec)
    assert d == tool_durations(AgentMixSpec(workers=500, turns=(5, 5), seed=2))
    assert d != tool_durations(AgentMixSpec(workers=500, turns=(5, 5), seed=3))
    assert {len(row) for row in d} == {4}
    flat = [x for row in d for x in row]
    assert max(flat) <= 4.0 * 3.0 and min(flat) > 0
    logs = [math.log(x) for x in flat]
    assert statistics.median(flat) == pytest.approx(3.0, rel=0.06)
    # Heavy tail: the cap trims only the top ~1 %, so the log-sd stays close to sigma.
    assert statistics.stdev(logs) == pytest.approx(0.6, abs=0.04)
    assert statistics.mean(flat) > statistics.median(flat)
    half = tool_durations(spec, 0.5)
    assert half[0] == pytest.approx([x / 2 for x in d[0]], abs=1e-3)
    assert tool_durations(AgentMixSpec(workers=2, turns=(1, 1))) == [[], []]


def test_hints_are_the_median_except_the_wrong_one():
    spec = AgentMixSpec(tool_median_s=3.0, hint_error=2.0)
    assert hints(spec) == {"lookup": 3.0, "crawl": 1.5}
    assert hints(spec, 0.1) == pytest.approx({"lookup": 0.3, "crawl": 0.15})
    # Alternating tools: every worker with >= 2 tool calls uses both.
    assert {tool_for(w, s) for w in range(3) for s in range(2)} == {"lookup", "crawl"}
    assert tool_for(0, 0) != tool_for(0, 1) and tool_for(0, 0) != tool_for(1, 0)


def test_stall_events_carry_both_tools_with_their_hints():
    spec = AgentMixSpec(**{**TINY, "turns": (3, 3), "tool_median_s": 0.02, "hint_error": 4.0}, seed=9)
    result, _, _ = _run(spec)
    begins = [e for e in result.stall_events if getattr(e, "predicted_s", None) is not None]
    by_tool = {e.tool: e.predicted_s for e in begins}
    assert by_tool == pytest.approx({"lookup": 0.02, "crawl": 0.005})
    assert {e.agent_type for e in begins} == {WORKER_TYPE}
    assert len(begins) == 3 * 2


def test_shared_prefix_is_identical_across_workers_and_apps_and_absent_in_hetero():
    shared = [AgentMixSpec(workers=3, shared_prefix_tokens=300, context_tokens=100, seed=s) for s in (1, 2)]
    prompts = [system_prompt(spec, w) for spec in shared for w in plan(spec)]
    common = _common_prefix(prompts)
    assert common.startswith(preamble(shared[0])) and len(preamble(shared[0]).split()) >= 280
    assert preamble(shared[0]) == preamble(shared[1])
    assert len(set(prompts)) == len(prompts)  # private parts differ
    hetero = AgentMixSpec(workers=3, shared_prefix_tokens=0, context_tokens=400, seed=1)
    assert preamble(hetero) == ""
    hetero_prompts = [system_prompt(hetero, w) for w in plan(hetero)]
    # Nothing beyond the short "Worker file <seed>-" header is shared: far less than one KV block.
    assert len(_common_prefix(hetero_prompts).split()) <= 3
    # One sentence-ending period per 8-16 words counts against the budget: ~1 token per planned token.
    for p, w in zip(hetero_prompts, plan(hetero), strict=True):
        assert 0.85 * w.private_tokens <= len(p.split()) <= w.private_tokens + 8


def test_workers_loop_on_one_conversation_start_staggered_and_join_sees_last_replies():
    spec = AgentMixSpec(**TINY, seed=3)
    result, requests, first = _run(spec)
    workers = plan(spec)
    sessions: dict[str, list[dict]] = {}
    for body in requests:
        sessions.setdefault(body["kv_transfer_params"]["tokencake"]["session_id"], []).append(body)
    for w in workers:
        bodies = sessions[f"r1:worker_{w.index}"]
        assert len(bodies) == w.turns
        assert result.nodes[f"worker_{w.index}"].tool_calls == w.turns - 1
        for prev, cur in itertools.pairwise(bodies):
            assert cur["messages"][: len(prev["messages"])] == prev["messages"]
    # A lower bound from the run's start (a loaded machine only delays a worker, never advances it).
    t0 = first["<start>"]
    for w in workers[1:]:
        assert first[f"worker_{w.index}"] - t0 >= w.start_s - 0.02
    (join,) = sessions["r1:join"]
    prompt = join["messages"][-1]["content"]
    for w in workers:
        assert f"worker_{w.index} says {w.turns - 1}" in prompt
    assert result.output == "join says 0"
    assert len(requests) == sum(w.turns for w in workers) + 1


def test_from_params_round_trips_json_and_validates():
    spec = AgentMixSpec.from_params({"turns": [2, 4], "workers": 2, "shared_prefix_tokens": 10})
    assert spec.turns == (2, 4) and spec.workers == 2
    assert AgentMixSpec.from_params({"turns": 3}).turns == (3, 3)
    with pytest.raises(ValueError, match="unknown"):
        AgentMixSpec.from_params({"agents": 3})
    for bad in (
        dict(workers=0),
        dict(turns=(4, 3)),
        dict(turns=(0, 2)),
        dict(tool_cap=0.5),
        dict(hint_error=0),
        dict(stagger_s=-1),
    ):
        with pytest.raises(ValueError):
            AgentMixSpec(**bad)
