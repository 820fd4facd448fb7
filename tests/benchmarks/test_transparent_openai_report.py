"""``benchmarks/transparent_openai_report.py``: the recovered fraction, its interval, the pooled rounds."""

import importlib.util
from pathlib import Path

import pytest

from tokencake.bench.intervals import mean_ci

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "transparent_openai_report.py"
_spec = importlib.util.spec_from_file_location("transparent_openai_report", _PATH)
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def test_recovered_is_the_ratio_of_mean_gains():
    rec = report.recovered_fraction([10.0, 12.0, 11.0], [9.0, 11.0, 10.0], [8.0, 10.0, 9.0])
    assert rec["estimate"] == pytest.approx(0.5)
    assert rec["per_round"] == pytest.approx([0.5, 0.5, 0.5])
    assert rec["ci95"] == pytest.approx([0.5, 0.5])  # the same gains every round: no spread
    # ratio of mean gains, not mean of per-round ratios: rounds with a larger SDK gain weigh more
    rec = report.recovered_fraction([10.0, 20.0], [9.0, 12.0], [8.0, 10.0])
    assert rec["estimate"] == pytest.approx((1 + 8) / (2 + 10))
    assert rec["per_round"] == pytest.approx([0.5, 0.8])


def test_with_a_constant_sdk_gain_the_interval_is_the_transparent_gains_t_interval_scaled():
    stock, sdk = [10.0, 10.0, 10.0], [8.0, 8.0, 8.0]
    transparent = [9.0, 8.5, 9.5]
    rec = report.recovered_fraction(stock, transparent, sdk)
    gains = mean_ci([s - t for s, t in zip(stock, transparent, strict=True)])
    assert rec["estimate"] == pytest.approx(0.5)
    assert rec["ci95"] == pytest.approx([x / 2.0 for x in gains["ci95"]])
    assert rec["ci95"][0] < 0.5 < rec["ci95"][1]


def test_no_sdk_gain_leaves_nothing_to_recover():
    rec = report.recovered_fraction([10.0, 10.0], [9.0, 9.0], [10.0, 11.0])
    assert rec["estimate"] is None and rec["ci95"] is None
    assert rec["per_round"] == [None, None]


def test_one_round_has_an_estimate_without_interval_and_lengths_must_match():
    rec = report.recovered_fraction([10.0], [9.0], [8.0])
    assert rec["estimate"] == pytest.approx(0.5) and rec["ci95"] is None
    with pytest.raises(ValueError):
        report.recovered_fraction([10.0, 9.0], [9.0], [8.0])


def _run(times: dict[int, float | None]) -> dict:
    agents = [
        {"index": i, "agent_s": t or 0.0, "status": "ok" if t is not None else "failed"}
        for i, t in times.items()
    ]
    done = [t for t in times.values() if t is not None]
    return {
        "agents": agents,
        "agent_s": {"p90": max(done)},
        "makespan_s": max(done),
        "prefix_tokens": {"computed": 100.0, "from_host": 0.0},
        "extension": None,
        "http_errors": 0,
        "agents_failed": len(times) - len(done),
    }


def test_aggregate_pairs_agents_that_finished_everywhere():
    rounds = []
    for r, (stock, transparent, sdk) in enumerate([(20.0, 17.0, 16.0), (24.0, 20.0, 20.0)], start=1):
        systems = {
            "stock": _run({0: stock, 1: stock}),
            "transparent": _run({0: transparent, 1: transparent}),
            # agent 1 failed on sdk in round 2: that round's means use agent 0 only, on every system
            "sdk": _run({0: sdk, 1: sdk if r == 1 else None}),
        }
        systems["stock"]["agents"][1]["agent_s"] = stock + (100.0 if r == 2 else 0.0)
        rounds.append({"round": r, "systems": systems})
    out = report.aggregate(rounds, ["stock", "transparent", "sdk"])
    assert out["systems"]["stock"]["mean_agent_s"]["per_round"] == [20.0, 24.0]
    assert out["ratios"]["sdk/stock"]["per_round"]["per_round"] == pytest.approx([0.8, 20 / 24])
    rec = out["recovered"]
    assert rec["estimate"] == pytest.approx((3 + 4) / (4 + 4))
    assert rec["meets_target"] is True  # 0.875 >= 0.8
    assert out["systems"]["sdk"]["agents_failed"] == 1
    by_agent = out["ratios"]["transparent/stock"]["by_agent"]
    assert by_agent["n_pairs"] == 4 and by_agent["n_apps"] == 2  # clustered by round
