"""Interleaved rounds pooled: per-round headlines with t intervals, paired bootstrap, reaggregation."""

from collections import Counter

import pytest

from tokencake.bench.rounds import aggregate, balanced_orders


def test_aggregate_gives_every_headline_per_round_with_a_t_interval(make_round):
    ext = [
        {"next_turn_recomputed_share": share, "ready_rate": 0.5, "prefetch_on_time_rate": None}
        for share in (0.2, 0.3, 0.4)
    ]
    rounds = [
        make_round(i + 1, baseline=20.0, tokencake=(tc_, ext[i]), ideal=15.0, tokencake_roomy=roomy)
        for i, (tc_, roomy) in enumerate([(16.0, 15.3), (18.0, 15.0), (17.0, 15.15)])
    ]
    agg = aggregate(rounds)["p"]["rounds"]
    # By hand, t(2) = 4.303 and half width = 4.303 * sd / sqrt(3):
    # tokencake/baseline 0.80, 0.90, 0.85 -> mean 0.85, sd 0.05, half 0.12422
    tb = agg["tokencake/baseline"]
    assert tb["per_round"] == pytest.approx([0.8, 0.9, 0.85])
    assert tb["mean"] == pytest.approx(0.85) and tb["half_width"] == pytest.approx(0.12422, abs=1e-5)
    assert tb["ci95"] == pytest.approx([0.85 - 0.12422, 0.85 + 0.12422], abs=1e-5)
    # captured (20 - t) / (20 - 15): 0.8, 0.4, 0.6 -> mean 0.6, sd 0.2, half 0.49687
    cf = agg["captured_fraction"]
    assert cf["per_round"] == pytest.approx([0.8, 0.4, 0.6])
    assert cf["mean"] == pytest.approx(0.6) and cf["half_width"] == pytest.approx(0.49687, abs=1e-5)
    # tokencake/ideal 16/15, 18/15, 17/15 -> sd 1/15, half 0.16562
    assert agg["tokencake/ideal"]["mean"] == pytest.approx(17 / 15)
    assert agg["tokencake/ideal"]["half_width"] == pytest.approx(0.16562, abs=1e-5)
    # roomy/ideal 1.02, 1.00, 1.01 -> sd 0.01, half 0.02484
    assert agg["tokencake-roomy/ideal"]["mean"] == pytest.approx(1.01)
    assert agg["tokencake-roomy/ideal"]["half_width"] == pytest.approx(0.02484, abs=1e-5)
    share = agg["next_turn_recomputed_share"]
    assert share["mean"] == pytest.approx(0.3) and share["half_width"] == pytest.approx(0.24843, abs=1e-5)
    assert agg["ready_rate"]["ci95"] == pytest.approx([0.5, 0.5])
    assert "prefetch_on_time_rate" not in agg  # measured in no round
    assert agg["baseline/ideal"]["n"] == 3
    # Each system's own numbers per round too (the fixture's computed prompt tokens = 1000 x E2E).
    assert agg["tokencake:e2e_mean_s"]["per_round"] == pytest.approx([16.0, 18.0, 17.0])
    assert agg["baseline:computed_prompt_tokens"]["mean"] == pytest.approx(20000.0)
    assert "ideal:prefix_hit_rate" not in agg  # not measured by the fixture


def test_aggregate_pairs_apps_across_systems_with_a_bootstrap_interval(make_round):
    rounds = [
        make_round(i + 1, baseline=b, tokencake=t, offload_all=o, continuum=c)
        for i, (b, t, o, c) in enumerate(
            [(20.0, 10.0, 14.0, 19.0), (22.0, 11.0, 15.0, 21.0), (21.0, 12.0, 13.0, 20.0)]
        )
    ]
    paired = aggregate(rounds)["p"]["paired"]
    tb = paired["tokencake/baseline"]
    assert tb["n_pairs"] == 3 and tb["ratio"] == pytest.approx(33 / 63)
    lo, hi = tb["ci95"]
    assert lo <= tb["ratio"] <= hi
    assert paired["tokencake/offload-all"]["ratio"] == pytest.approx(33 / 42)
    assert paired["tokencake/continuum"]["ratio"] == pytest.approx(33 / 60)
    assert "tokencake/ideal" not in paired  # no ideal ran


def test_app_pairs_match_by_run_id_and_skip_failures():
    from tokencake.bench.rounds import app_pairs

    def sys_(apps):
        return {"apps": [{"run_id": r, "status": s, "e2e_s": e} for r, s, e in apps]}

    point = {
        "systems": {
            "a": sys_([("x", "ok", 1.0), ("y", "ok", 2.0), ("z", "failed", 3.0)]),
            "b": sys_([("y", "ok", 4.0), ("x", "ok", 5.0), ("z", "ok", 6.0)]),
        }
    }
    assert sorted(app_pairs([point], "a", "b")) == [(1.0, 5.0), (2.0, 4.0)]
    assert app_pairs([point], "a", "missing") == []


def test_reaggregating_a_stored_run_reproduces_what_the_bench_wrote() -> None:
    """``benchmarks/reaggregate.py`` only adds pairs: on a run whose systems no new pair names, the
    recomputed comparisons and aggregate (seeded bootstrap included) equal the stored ones — also
    from a trimmed file (``benchmarks/trim_results.py`` keeps what the aggregation reads)."""
    import copy
    import json
    from pathlib import Path

    from tokencake.bench.rounds import reaggregate

    stored = json.loads((Path(__file__).parents[2] / "docs/bench/unseen-real-6-pop-results.json").read_text())
    assert stored["trimmed"]
    again = reaggregate(copy.deepcopy(stored))
    assert again["aggregate"] == stored["aggregate"]
    assert [p["comparison"] for p in again["points"]] == [p["comparison"] for p in stored["points"]]


@pytest.mark.parametrize("n,rounds", [(2, 4), (3, 6), (4, 5), (5, 3)])
def test_balanced_orders_are_latin_square_rows(n, rounds):
    names = [f"s{i}" for i in range(n)]
    orders = balanced_orders(names, rounds, seed="x")
    assert orders == balanced_orders(names, rounds, seed="x")
    assert len(orders) == rounds and all(sorted(o) == names for o in orders)
    for position in range(n):
        counts = Counter(o[position] for o in orders)
        assert max(counts.values()) - min(counts.get(x, 0) for x in names) <= 1
