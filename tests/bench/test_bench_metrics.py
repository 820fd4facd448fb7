import pytest

from tokencake.bench.metrics import client_summary, percentile, summarize


def test_percentile_linear_interpolation():
    data = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert percentile(data, 50) == pytest.approx(5.5)
    assert percentile(data, 95) == pytest.approx(9.55)
    assert percentile(data, 0) == 1 and percentile(data, 100) == 10
    assert percentile([4.0], 99) == 4.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(data, 101)


def test_summarize():
    s = summarize([3.0, 1.0, 2.0])
    assert s["count"] == 3 and s["mean"] == pytest.approx(2.0) and s["p50"] == 2.0
    assert s["min"] == 1.0 and s["max"] == 3.0
    assert summarize([])["mean"] is None


def test_client_summary_and_node_breakdown():
    apps = [
        {
            "app": "m",
            "status": "ok",
            "e2e_s": 10.0,
            "nodes": {"a": {"llm_s": 4.0, "tool_s": 6.0, "queue_s": 0.0}},
        },
        {
            "app": "m",
            "status": "ok",
            "e2e_s": 20.0,
            "nodes": {"a": {"llm_s": 8.0, "tool_s": 6.0, "queue_s": 0.0}},
        },
        {"app": "m", "status": "failed", "e2e_s": 1.0},
    ]
    calls = [{"status": 200, "latency_s": 1.0, "prompt_tokens": 5, "completion_tokens": 2}, {"status": 500}]
    s = client_summary(apps, calls)
    assert s["apps_failed"] == 1 and s["e2e_s"]["mean"] == 15.0
    assert s["calls_failed"] == 1 and s["completion_tokens"] == 2
    assert s["node_breakdown_s"]["m:a"] == {"llm_s": 6.0, "tool_s": 6.0, "queue_s": 0.0}
