import itertools

import pytest

import tokencake as tc
from tokencake.bench.synthetic import MultiTurnSpec, build_app, document, tool_durations


def test_documents_are_seeded_private_and_about_the_requested_length():
    spec = MultiTurnSpec(agents=3, context_tokens=600, seed=5)
    docs = [document(spec, i) for i in range(3)]
    assert docs == [document(MultiTurnSpec(agents=3, context_tokens=600, seed=5), i) for i in range(3)]
    # No two agents share a prefix: the first words already differ.
    assert len({d[:30] for d in docs}) == 3
    for d in docs:
        assert 550 <= len(d.split()) <= 700
    assert document(MultiTurnSpec(seed=6, context_tokens=600), 0) != docs[0]


def test_tool_durations_are_seeded_within_range_and_scaled():
    spec = MultiTurnSpec(agents=2, turns=4, tool_s=(1.0, 3.0), seed=1)
    d = tool_durations(spec)
    assert d == tool_durations(spec)
    assert [len(x) for x in d] == [3, 3]
    assert all(1.0 <= x <= 3.0 for row in d for x in row)
    half = tool_durations(spec, 0.5)
    assert half[0][0] == pytest.approx(d[0][0] / 2, abs=1e-3)


def test_from_params_validates():
    assert MultiTurnSpec.from_params({"tool_s": 2}).tool_s == (2.0, 2.0)
    with pytest.raises(ValueError, match="unknown"):
        MultiTurnSpec.from_params({"turn": 3})
    with pytest.raises(ValueError):
        MultiTurnSpec(turns=0)
    with pytest.raises(ValueError):
        MultiTurnSpec(tool_s=(3.0, 1.0))


def test_app_runs_turns_on_one_growing_conversation():
    spec = MultiTurnSpec(agents=2, turns=3, context_tokens=50, max_tokens=7, tool_s=(0.0, 0.01), seed=3)
    llm = tc.ScriptedLLM(lambda req: "fine")
    result = build_app(spec).run_sync(llm=llm, run_id="r1")
    assert set(result.nodes) == {"agent_0", "agent_1"}
    per_agent = {}
    for body in llm.requests:
        session = body["kv_transfer_params"]["tokencake"]["session_id"]
        per_agent.setdefault(session, []).append(body)
    assert sorted(per_agent) == ["r1:agent_0", "r1:agent_1"]
    for bodies in per_agent.values():
        assert len(bodies) == 3
        assert all(b["max_tokens"] == 7 for b in bodies)
        # Append-only: each turn's messages start with the previous turn's messages.
        for prev, cur in itertools.pairwise(bodies):
            assert cur["messages"][: len(prev["messages"])] == prev["messages"]
    assert all(n.tool_calls == 2 for n in result.nodes.values())
