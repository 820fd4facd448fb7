import math

import pytest

from tokencake.bench.intervals import mean_ci, t_critical


def test_t_critical_table_and_conservative_lookup():
    assert t_critical(1) == 12.706 and t_critical(2) == 4.303 and t_critical(30) == 2.042
    assert t_critical(35) == t_critical(30)  # between listed df: the smaller df, a wider interval
    assert t_critical(10_000) == 1.980
    assert all(t_critical(df) > t_critical(df + 1) for df in range(1, 30))
    with pytest.raises(ValueError):
        t_critical(0)


def test_mean_ci_by_hand():
    # mean 2.5, sample sd sqrt(5/3), half width t(3) * sd / sqrt(4) = 3.182 * 1.29099 / 2
    ci = mean_ci([1.0, 2.0, 3.0, 4.0])
    assert ci["n"] == 4 and ci["mean"] == pytest.approx(2.5)
    assert ci["sd"] == pytest.approx(1.290994, rel=1e-6)
    assert ci["half_width"] == pytest.approx(2.053972, rel=1e-6)
    assert ci["ci95"] == pytest.approx([2.5 - 2.053972, 2.5 + 2.053972], rel=1e-6)
    assert ci["per_round"] == [1.0, 2.0, 3.0, 4.0]


def test_mean_ci_skips_missing_rounds_and_needs_two():
    ci = mean_ci([0.8, None, 0.9, math.nan])
    assert ci["n"] == 2 and ci["mean"] == pytest.approx(0.85)
    assert ci["half_width"] == pytest.approx(12.706 * 0.0707107 / math.sqrt(2), rel=1e-5)
    assert ci["per_round"][1] is None
    one = mean_ci([0.7])
    assert one["mean"] == 0.7 and one["ci95"] is None and one["half_width"] is None
    assert mean_ci([])["mean"] is None
    flat = mean_ci([1.0, 1.0, 1.0])
    assert flat["ci95"] == [1.0, 1.0]


def test_paired_bootstrap_ratio_of_means_and_interval():
    from tokencake.bench.intervals import paired_ratio_bootstrap

    pairs = [(50.0, 100.0), (60.0, 110.0), (45.0, 95.0), (55.0, 105.0)]
    out = paired_ratio_bootstrap(pairs, resamples=500, seed=1)
    assert out["n_pairs"] == 4 and out["resamples"] == 500
    assert out["ratio"] == pytest.approx(210 / 410)
    lo, hi = out["ci95"]
    assert lo <= out["ratio"] <= hi and hi - lo < 0.1
    # Same seed, same interval; too few pairs, no interval.
    assert paired_ratio_bootstrap(pairs, resamples=500, seed=1) == out
    two = paired_ratio_bootstrap(pairs[:2])
    assert two["ratio"] == pytest.approx(110 / 210) and two["ci95"] is None
    assert paired_ratio_bootstrap([])["ratio"] is None


def test_paired_bootstrap_resamples_apps_then_their_rounds():
    """An app's rounds replay one workload: apps whose ratios differ, each steady over its rounds,
    give a wide interval resampled by app and a narrow one resampled as if every pair were its own
    sample (which understates the spread)."""
    from tokencake.bench.intervals import paired_ratio_bootstrap

    pairs, apps = [], []
    for app, r in (("x", 0.8), ("y", 1.0), ("z", 1.2)):
        for noise in (-0.5, 0.0, 0.5):
            pairs.append((r * (100 + noise), 100 + noise))
            apps.append(app)
    by_app = paired_ratio_bootstrap(pairs, resamples=1000, seed=3, clusters=apps)
    by_pair = paired_ratio_bootstrap(pairs, resamples=1000, seed=3)
    assert by_app["n_pairs"] == by_pair["n_pairs"] == 9
    assert by_app["n_apps"] == 3 and by_app["resampled"] == "apps, then each app's rounds"
    assert by_pair["resampled"] == "pairs"
    assert by_app["ratio"] == pytest.approx(by_pair["ratio"]) == pytest.approx(1.0, abs=1e-3)
    width = lambda out: out["ci95"][1] - out["ci95"][0]  # noqa: E731
    assert width(by_app) > 1.2 * width(by_pair)
    # One app: its rounds are all there is to resample.
    one = paired_ratio_bootstrap(pairs[:3], resamples=200, seed=3, clusters=apps[:3])
    assert one["n_apps"] == 1 and one["resampled"] == "pairs" and one["ci95"] is not None
    with pytest.raises(ValueError, match="one app per pair"):
        paired_ratio_bootstrap(pairs, clusters=apps[:2])
