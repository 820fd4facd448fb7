"""The ``stress`` preset: its two points, their workloads, and the KV sizes it derives from them."""

import pytest

from tokencake.bench import presets
from tokencake.bench.agent_mix import AgentMixSpec, plan, preamble, question, system_prompt, tool_result
from tokencake.bench.presets import CPU_BLOCK_TOKENS, Overrides
from tokencake.bench.workload import AGENT_MIX_APP

#: SmolLM2 tokens per word of the seeded text measure ~1.13; bound with margin.
TOKENS_PER_WORD = 1.2


def _specs(point):
    return [AgentMixSpec.from_params(a.params) for a in point.workload.arrivals]


def _final_words(spec, worker, shared: bool) -> int:
    """Words of a worker's last prompt: system prompt + every turn's question, tool result and reply."""
    words = len(system_prompt(spec, worker).split())
    if shared:
        words -= len(preamble(spec).split())
    for turn in range(worker.turns):
        words += len(question(worker.index, turn).split()) + spec.max_tokens + 4  # + role markup
        if turn:
            words += len(tool_result(spec, worker.index, turn - 1).split())
    return words


def test_two_points_differ_only_in_the_prefix_structure():
    config = presets.build("stress")
    assert [p.label for p in config.points] == ["hetero", "shared"]
    hetero, shared = (p.workload for p in config.points)
    for wl in (hetero, shared):
        assert wl.arrival == "poisson" and wl.apps == [AGENT_MIX_APP] and "agent_mix" in wl.notes[0]
        assert wl.llm.max_tokens == 24 and wl.llm.ignore_eos
    # Same arrival times, same shapes, same tool times: the points isolate the shared prefix.
    assert [a.at_s for a in hetero.arrivals] == [a.at_s for a in shared.arrivals]
    assert len({a.at_s for a in hetero.arrivals}) == len(hetero.arrivals) >= 2
    for h, s in zip(_specs(config.points[0]), _specs(config.points[1]), strict=True):
        assert h.shared_prefix_tokens == 0 and s.shared_prefix_tokens > s.context_tokens
        assert [w.turns for w in plan(h)] == [w.turns for w in plan(s)]
    assert {a.run_id.rsplit("-", 1)[0] for a in hetero.arrivals} == {"stress-hetero"}


def test_default_budget_conversations_and_pressure():
    config = presets.build("stress")
    for point in config.points:
        specs = _specs(point)
        calls = sum(w.turns for spec in specs for w in plan(spec)) + len(specs)
        assert 35 <= calls <= 45, point.label  # about 2.5 min per system on 2 CPU cores
        shared = point.label == "shared"
        longest = max(_final_words(spec, w, False) for spec in specs for w in plan(spec))
        assert longest * TOKENS_PER_WORD < config.server.max_model_len - 1024
        # The ideal holds every session's final context at once (the shared preamble once) ...
        need = sum(_final_words(spec, w, shared) for spec in specs for w in plan(spec))
        need += len(preamble(specs[0]).split())
        # ... which is more than the constrained device KV holds, even with the prefix shared.
        assert need > 1.5 * config.server.device_blocks * CPU_BLOCK_TOKENS
        assert config.server.ideal_blocks * CPU_BLOCK_TOKENS >= need * TOKENS_PER_WORD
        # The host pool can hold every worker's context, preamble included.
        assert config.server.host_pool_blocks * CPU_BLOCK_TOKENS >= need * TOKENS_PER_WORD
    assert config.server.device_blocks == 40


def test_shared_prefix_counts_once_in_the_ideal():
    one = presets.agent_mix_blocks([AgentMixSpec(workers=4, context_tokens=400, shared_prefix_tokens=1000)])
    alone = presets.agent_mix_blocks([AgentMixSpec(workers=4, context_tokens=400)])
    extra_ideal, extra_host = one[0] - alone[0], one[1] - alone[1]
    preamble_blocks = 1000 * 1.25 / CPU_BLOCK_TOKENS
    assert preamble_blocks <= extra_ideal <= preamble_blocks + 1
    assert extra_host >= 2 * 4 * (preamble_blocks - 1)  # one copy per worker on the host, doubled


def test_overrides_apply():
    o = Overrides(
        apps=1,
        workers=2,
        turns=4,
        context_tokens=600,
        tool_s=(1.0, 3.0),
        max_tokens=8,
        device_blocks=30,
        seed=5,
        systems=["baseline"],
    )
    config = presets.build("stress", o)
    hetero, shared = (_specs(p) for p in config.points)
    assert len(hetero) == len(shared) == 1
    h, s = hetero[0], shared[0]
    assert (h.workers, h.turns, h.context_tokens, h.tool_median_s, h.max_tokens) == (2, (4, 4), 600, 2.0, 8)
    assert (s.shared_prefix_tokens, s.context_tokens) == (500, 300)
    assert config.server.device_blocks == 30 and config.server.ideal_blocks >= 60
    assert [x.name for x in config.systems] == ["baseline"]
    assert config.points[0].workload.seed == 5 and config.order_seed == 5 and config.shuffle_systems
    pinned = presets.build("stress", Overrides(ideal_blocks=500, host_pool_blocks=77, fixed_order=True))
    assert pinned.server.ideal_blocks == 500 and pinned.server.host_pool_blocks == 77
    assert not pinned.shuffle_systems
    swept = presets.build("stress", Overrides(rates=[0.1, 0.5]))
    assert [p.label for p in swept.points] == ["hetero@0.1/s", "hetero@0.5/s", "shared@0.1/s", "shared@0.5/s"]
    # A catalog app in the mix cannot be sized: the ideal falls back to the server's default KV.
    mixed = presets.build("stress", Overrides(mix={AGENT_MIX_APP: 1.0, "map-reduce": 1.0}, apps=4, seed=1))
    assert mixed.server.ideal_blocks is None
    with pytest.raises(ValueError):
        presets.build("stress", Overrides(workers=0))


def test_points_subset():
    cfg = presets.build("stress", Overrides(points=["shared"]))
    assert [p.label for p in cfg.points] == ["shared"]
    with pytest.raises(ValueError, match="unknown stress point"):
        presets.build("stress", Overrides(points=["nope"]))


def test_headline_presets_default_to_five_interleaved_rounds():
    from tokencake.bench import presets

    assert presets.build("stress").repeat == 5
    assert presets.build("headroom").repeat == 5
    assert presets.build("ci").repeat == 1
    assert presets.build("stress", presets.Overrides(repeat=2)).repeat == 2
