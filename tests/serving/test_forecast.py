from __future__ import annotations

import math

import pytest

from tokencake.serving.forecast import MAX_FORECAST_S, DurationForecaster
from tokencake.serving.prefetch import stall_expiry_s


def test_cold_start_uses_default() -> None:
    fc = DurationForecaster(default_s=1.5)
    f = fc.predict("planner", "search")
    assert (f.seconds, f.source, f.samples) == (1.5, "default", 0)
    assert f.low == f.high == 1.5


def test_hint_only_and_stages_fallback() -> None:
    fc = DurationForecaster()
    assert fc.predict("a", "t", hint_s=4.0).seconds == 4.0
    assert fc.predict("a", "t", hint_s=4.0).source == "hint"
    # The explicit hint wins over the stages' sum.
    assert fc.predict("a", "t", hint_s=4.0, stages={"x": 1.0, "y": 1.0}).seconds == 4.0
    f = fc.predict("a", "t", stages={"query": 0.5, "execute": 1.0, "results": 0.5})
    assert (f.seconds, f.source) == (2.0, "stages")


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_hint_is_ignored(bad: float) -> None:
    fc = DurationForecaster(default_s=1.0)
    f = fc.predict("a", "t", hint_s=bad, stages={"x": bad})
    assert (f.seconds, f.source) == (1.0, "default")


def test_history_only_is_ewma() -> None:
    fc = DurationForecaster(alpha=0.5)
    fc.observe("a", "t", 2.0)
    assert fc.predict("a", "t").seconds == 2.0
    fc.observe("a", "t", 4.0)
    f = fc.predict("a", "t")
    assert f.source == "history"
    assert f.seconds == pytest.approx(3.0)  # 0.5*4 + 0.5*2
    fc.observe("a", "t", 1.0)
    assert fc.predict("a", "t").seconds == pytest.approx(2.0)  # 0.5*1 + 0.5*3
    assert f.low <= f.seconds <= f.high


def test_keys_are_separate() -> None:
    fc = DurationForecaster()
    fc.observe("a", "t", 5.0)
    assert fc.predict("b", "t").source == "default"
    assert fc.predict("a", "u").source == "default"


def test_blend_is_weighted_mean() -> None:
    fc = DurationForecaster(alpha=0.5)
    fc.observe("a", "t", 2.0)
    f = fc.predict("a", "t", hint_s=6.0)
    assert (f.seconds, f.source, f.hint_s, f.history_s) == (4.0, "blend", 6.0, 2.0)
    fc2 = DurationForecaster(hint_weight=0.25)
    fc2.observe("a", "t", 2.0)
    assert fc2.predict("a", "t", hint_s=6.0).seconds == pytest.approx(3.0)


def test_quantile_bounds_from_history() -> None:
    fc = DurationForecaster(window=8)
    for v in [1, 2, 3, 4, 5, 6, 7, 8, 20, 20]:  # window keeps the last 8: 3..8, 20, 20
        fc.observe("a", "t", float(v))
    stats = fc.key_stats("a", "t")
    assert stats is not None
    assert stats["samples"] == 10
    assert stats["p50_s"] == pytest.approx(6.5)
    f = fc.predict("a", "t")
    assert f.low < f.seconds < f.high
    assert f.high >= stats["p90_s"]


def test_error_statistics_per_key_and_global() -> None:
    fc = DurationForecaster()
    fc.observe("a", "t", actual_s=3.0, predicted_s=4.0)  # +1 (over)
    fc.observe("a", "t", actual_s=5.0, predicted_s=2.0)  # -3 (under)
    fc.observe("b", "t", actual_s=1.0)  # no prediction: no error sample
    key = fc.key_stats("a", "t")
    assert key is not None
    assert key["error"] == {"count": 2, "mae_s": 2.0, "mean_signed_error_s": -1.0}
    glob = fc.stats()
    assert glob["error"]["count"] == 2
    assert glob["keys"] == 2
    assert fc.key_stats("b", "t")["error"]["count"] == 0  # type: ignore[index]


def test_bad_observations_are_ignored() -> None:
    fc = DurationForecaster()
    fc.observe("a", "t", -1.0)
    fc.observe("a", "t", math.nan)
    assert fc.key_stats("a", "t") is None


def test_bounded_lru_of_keys() -> None:
    fc = DurationForecaster(max_keys=2)
    fc.observe("a", "1", 1.0)
    fc.observe("a", "2", 2.0)
    fc.predict("a", "1")  # touch key 1: key 2 is now least recently used
    fc.observe("a", "3", 3.0)
    assert fc.key_stats("a", "2") is None
    assert fc.key_stats("a", "1") is not None
    assert fc.stats()["evicted_keys"] == 1


def test_predictions_counted_by_source() -> None:
    fc = DurationForecaster()
    fc.predict("a", "t")
    fc.predict("a", "t", hint_s=1.0)
    assert fc.stats()["predictions_by_source"] == {"default": 1, "hint": 1}


def test_invalid_config() -> None:
    with pytest.raises(ValueError, match="alpha"):
        DurationForecaster(alpha=0)
    with pytest.raises(ValueError, match="hint_weight"):
        DurationForecaster(hint_weight=2)


def test_hint_is_capped_so_one_begin_cannot_pin_for_an_hour() -> None:
    fc = DurationForecaster()
    f = fc.predict("a", "t", hint_s=900.0)
    assert f.seconds == f.hint_s == MAX_FORECAST_S
    assert fc.predict("a", "t", stages={"x": 5000.0}).seconds == MAX_FORECAST_S
    assert fc.stats()["clamped_hints"] == 2
    # The stall's expiry (how long its host pins may live without a stall_end) follows the forecast.
    assert stall_expiry_s(f.seconds) <= 20 * 60


def test_one_bogus_duration_cannot_poison_the_shared_forecast() -> None:
    fc = DurationForecaster()
    for _ in range(5):
        fc.observe("a", "search", 2.0, predicted_s=2.0)
    fc.observe("a", "search", 86_400.0, predicted_s=2.0)  # a hostile (or broken) stall_end
    after = fc.predict("a", "search")
    # The report counted as at most max(4 x 2 s, 30 s): the EWMA moved from 2 s to at most 16 s.
    assert after.seconds <= 16.0
    assert fc.stats()["clamped_observations"] == 1
    assert fc.key_stats("a", "search")["p90_s"] <= 30.0  # type: ignore[index]


def test_a_tool_that_really_slowed_down_is_still_learned() -> None:
    fc = DurationForecaster()
    for _ in range(3):
        fc.observe("a", "t", 1.0, predicted_s=1.0)
    for _ in range(6):
        fc.observe("a", "t", 200.0, predicted_s=fc.predict("a", "t").seconds)
    assert fc.predict("a", "t").seconds > 150.0


def test_first_report_without_reference_counts_up_to_the_cap() -> None:
    fc = DurationForecaster()
    fc.observe("a", "t", 120.0)  # nothing to compare with: accepted (a slow tool, no hint)
    assert fc.predict("a", "t").seconds == 120.0
    fc.observe("b", "t", 1e9)
    assert fc.predict("b", "t").seconds == MAX_FORECAST_S
