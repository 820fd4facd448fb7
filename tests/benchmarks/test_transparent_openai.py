"""``benchmarks/transparent_openai.py``: seeded agent plans, balanced round orders, each arm's server."""

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

from tokencake.bench.systems import ServerConfig

_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
_spec = importlib.util.spec_from_file_location("transparent_openai", _DIR / "transparent_openai.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["transparent_openai"] = bench  # dataclasses look their module up there
sys.path.insert(0, str(_DIR))  # the script imports its report module from beside it
try:
    _spec.loader.exec_module(bench)
finally:
    sys.path.remove(str(_DIR))


def test_plans_are_seeded_and_within_the_workload_ranges():
    spec = bench.WorkloadSpec()
    plans = bench.plan_agents(spec, 7)
    assert plans == bench.plan_agents(spec, 7) and plans != bench.plan_agents(spec, 8)
    assert len(plans) == spec.agents
    names = [t["function"]["name"] for t in bench.TOOLS]
    for p in plans:
        assert spec.turns[0] <= len(p.tools) <= spec.turns[1] and len(p.tool_s) == len(p.tools)
        assert spec.context_words[0] <= p.context_words <= spec.context_words[1]
        assert all(spec.tool_range_s[0] <= s <= spec.tool_range_s[1] for s in p.tool_s)
        assert 0.0 <= p.start_s <= spec.start_spread_s
        assert all(t in names for t in p.tools)
    # heavy-tailed: some calls far above the median, and agents differ in size
    every = [s for p in bench.plan_agents(bench.WorkloadSpec(agents=64), 1) for s in p.tool_s]
    assert max(every) > 2 * spec.tool_median_s > min(every) * 2
    assert len({p.context_words for p in plans}) > 1


def test_agents_share_the_system_prompt_and_differ_in_their_document():
    spec = bench.WorkloadSpec(agents=2)
    a, b = bench.plan_agents(spec, 3)
    assert bench.shared_system(3, spec) == bench.shared_system(3, spec)
    assert bench.private_document(3, a) != bench.private_document(3, b)
    assert bench.tool_result(3, spec, a, 0) == bench.tool_result(3, spec, a, 0)


@pytest.mark.parametrize("rounds", [1, 3, 6])
def test_round_orders_put_each_system_in_each_position_equally(rounds):
    systems = list(bench.ARMS)
    orders = bench.round_orders(systems, rounds, seed=5)
    assert orders == bench.round_orders(systems, rounds, seed=5)
    assert len(orders) == rounds and all(sorted(o) == sorted(systems) for o in orders)
    if rounds % len(systems) == 0:
        for position in range(len(systems)):
            counts = Counter(o[position] for o in orders)
            assert set(counts.values()) == {rounds // len(systems)}


class _WithTransparent:
    def __init__(self, model=None, *, baseline=False, num_gpu_blocks=None, max_model_len=None,
                 eager=True, host_pool_blocks=None, scheduler_cls=None, policy=None,
                 offload=True, prefetch=True, demand_load=True, transparent=True):  # fmt: skip
        pass


class _WithoutTransparent:
    def __init__(self, model=None, *, baseline=False, num_gpu_blocks=None, max_model_len=None,
                 eager=True, host_pool_blocks=None, scheduler_cls=None, policy=None,
                 offload=True, prefetch=True, demand_load=True):  # fmt: skip
        pass


def test_arms_differ_only_in_what_is_compared():
    config = ServerConfig(model="m", device_blocks=40, host_pool_blocks=100)
    stock, transparent, sdk = (bench.arm_kwargs(a, config, _WithTransparent) for a in bench.ARMS)
    assert stock["baseline"] is True and "transparent" not in stock and "host_pool_blocks" not in stock
    assert transparent["transparent"] is True and sdk["transparent"] is False
    assert {k: v for k, v in transparent.items() if k != "transparent"} == {
        k: v for k, v in sdk.items() if k != "transparent"
    }
    for kwargs in (stock, transparent, sdk):
        assert kwargs["num_gpu_blocks"] == 40 and kwargs["model"] == "m"


def test_without_transparent_mode_only_the_transparent_arm_refuses():
    config = ServerConfig(device_blocks=40)
    assert "transparent" not in bench.arm_kwargs("sdk", config, _WithoutTransparent)
    with pytest.raises(RuntimeError, match="transparent"):
        bench.arm_kwargs("transparent", config, _WithoutTransparent)
