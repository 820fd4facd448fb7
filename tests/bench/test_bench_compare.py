"""One point's comparison: headline ratios over the apps every system finished, captured fraction."""

import pytest


def test_compare_reports_captured_fraction_roomy_cost_and_extension_shares(make_round):
    ext = {"next_turn_recomputed_share": 0.25, "ready_rate": 0.5, "on_time_rate_excl_not_needed": 0.4}
    comp = make_round(1, baseline=20.0, tokencake=(17.0, ext), ideal=16.0, tokencake_roomy=16.32)[
        "comparison"
    ]
    assert comp["captured_fraction"] == pytest.approx(0.75)
    assert comp["tokencake-roomy/ideal"]["mean"] == pytest.approx(1.02)
    assert comp["tokencake-roomy/baseline"]["mean"] == pytest.approx(16.32 / 20)
    assert comp["next_turn_recomputed_share"] == 0.25 and comp["ready_rate"] == 0.5
    assert comp["on_time_rate_excl_not_needed"] == 0.4
    # Nothing to capture when the ideal was not faster than the baseline.
    assert make_round(1, baseline=16.0, tokencake=17.0, ideal=16.0)["comparison"]["captured_fraction"] is None
    assert "captured_fraction" not in make_round(1, baseline=16.0, tokencake=17.0)["comparison"]


def test_round_ratios_compare_the_same_apps_when_one_was_lost():
    """An app that failed on one system leaves the other's mean over more apps: the per-round
    ratio and captured fraction use only the apps that finished on every system compared."""
    from tokencake.bench.compare import compare
    from tokencake.bench.rounds import paired_intervals

    def sys_(apps):
        done = [e for _r, s, e in apps if s == "ok"]
        return {
            "apps": [{"run_id": r, "status": s, "e2e_s": e} for r, s, e in apps],
            "client": {"e2e_s": {"mean": sum(done) / len(done), "p50": None, "p95": None, "p99": None}},
            "server": {"computed_prompt_tokens": 0},
        }

    systems = {
        "tokencake": sys_([("x", "ok", 10.0), ("y", "failed", 0.0), ("z", "ok", 30.0)]),
        "baseline": sys_([("x", "ok", 20.0), ("y", "ok", 100.0), ("z", "ok", 40.0)]),
        "ideal": sys_([("x", "ok", 5.0), ("y", "ok", 50.0), ("z", "ok", 15.0)]),
    }
    comp = compare(systems)
    assert comp["tokencake/baseline"]["mean"] == pytest.approx(40 / 60)  # not 20 / (160 / 3)
    assert comp["tokencake/ideal"]["mean"] == pytest.approx(40 / 20)
    assert comp["baseline/ideal"]["mean"] == pytest.approx(160 / 70)  # all three apps on both
    assert comp["captured_fraction"] == pytest.approx((30 - 20) / (30 - 10))
    paired = paired_intervals([{"systems": systems}] * 3)
    assert paired["tokencake/baseline"]["n_pairs"] == 6 and paired["tokencake/baseline"]["n_apps"] == 2


def test_tokencake_and_both_stock_orders_are_compared_with_the_true_reference(make_round):
    comp = make_round(
        1, baseline=20.0, baseline_priority=18.0, tokencake=16.5, tokencake_roomy=15.0, ideal=16.0
    )["comparison"]
    assert comp["tokencake/tokencake-roomy"]["mean"] == pytest.approx(1.1)
    assert comp["baseline-priority/tokencake-roomy"]["mean"] == pytest.approx(1.2)
    assert comp["baseline/tokencake-roomy"]["mean"] == pytest.approx(20 / 15)
    assert comp["tokencake/baseline-priority"]["mean"] == pytest.approx(16.5 / 18)
