from __future__ import annotations

import json
import math
import threading
import tracemalloc

import pytest

from tokencake.serving.stats import Histogram, Stats, quantile


def test_quantile_interpolates() -> None:
    assert quantile([1.0], 0.99) == 1.0
    assert quantile([0.0, 10.0], 0.5) == 5.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_histogram_window_and_totals() -> None:
    h = Histogram(window=3)
    for v in [100.0, 1.0, 2.0, 3.0, math.nan]:
        h.add(v)
    s = h.summary()
    assert s["count"] == 4
    assert s["max"] == 100.0  # exact totals cover every sample
    assert s["p50"] == 2.0  # quantiles cover the last 3
    assert Histogram().summary() == {"count": 0}


def test_counters_gauges_histograms_snapshot() -> None:
    st = Stats()
    st.inc("decisions.offload")
    st.inc("decisions.offload", 2)
    st.inc("decisions.too_short")
    st.set("host.free", 7)
    for v in range(1, 101):
        st.observe("copy_s", v / 1000)
    snap = st.snapshot()
    assert snap["counters"] == {"decisions.offload": 3, "decisions.too_short": 1}
    assert snap["gauges"] == {"host.free": 7}
    assert snap["histograms"]["copy_s"]["p50"] == pytest.approx(0.0505)
    assert snap["histograms"]["copy_s"]["p99"] == pytest.approx(0.09901)
    assert st.counters_with_prefix("decisions.") == {"offload": 3, "too_short": 1}
    assert st.counter("missing") == 0 and st.gauge("missing") is None
    json.dumps(snap)


def test_registered_sources_and_failures() -> None:
    st = Stats()
    st.register("forecast", lambda: {"keys": 2, "bad": math.inf, "tags": {"b", "a"}})
    st.register("broken", lambda: 1 / 0)
    snap = st.snapshot()
    assert snap["forecast"] == {"keys": 2, "bad": None, "tags": ["a", "b"]}
    assert snap["broken"]["error"].startswith("ZeroDivisionError")
    json.dumps(snap)
    st.inc("x")
    st.reset()
    assert st.snapshot()["counters"] == {}
    assert "forecast" in st.snapshot()


def test_thread_safe_increments() -> None:
    st = Stats()

    def work() -> None:
        for _ in range(5000):
            st.inc("n")
            st.observe("h", 1.0)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert st.counter("n") == 20000
    assert st.histogram("h")["count"] == 20000


def test_distinct_names_are_capped_so_memory_stays_bounded() -> None:
    stats = Stats(max_names=100, max_histograms=10, hist_window=64)
    tracemalloc.start()
    try:
        for i in range(100):  # fill up to the caps
            stats.inc(f"c.{i}")
            stats.set(f"g.{i}", i)
            stats.observe(f"h.{i}", float(i))
        base, _ = tracemalloc.get_traced_memory()
        for i in range(100, 20_000):  # a runaway label (a reason code built from input, say)
            stats.inc(f"c.{i}")
            stats.set(f"g.{i}", i)
            stats.observe(f"h.{i}", float(i))
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert grown - base < 16 << 10, f"{grown - base} bytes grew past the caps"
    snap = stats.snapshot()
    assert len(snap["counters"]) == 101 and len(snap["gauges"]) == 100 and len(snap["histograms"]) == 10
    assert stats.counter("stats.dropped_names") == 3 * 19_900 + 90
    stats.inc("c.5", 2)  # existing names keep counting
    assert stats.counter("c.5") == 3
    stats.reset()
    assert stats.counter("stats.dropped_names") == 0
