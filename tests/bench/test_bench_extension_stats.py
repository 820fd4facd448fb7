"""The extension's /v1/stats read as deltas over a replay, and several replicas' documents merged."""

import pytest

from tokencake.bench.extension_stats import extension_summary, merge_stats, stats_delta


def _snapshot(**counters):
    return {
        "counters": counters,
        "gauges": {},
        "histograms": {"offload.seconds": {"count": 2, "sum": 0.02, "mean": 0.01}},
        "config": {"offload": True},
    }


def test_extension_summary_reads_connector_counters_as_deltas():
    before = _snapshot(**{"offload.bytes": 1000, "prefetch.on_time": 1})
    after = _snapshot(
        **{
            "offload.bytes": 3_001_000,
            "offload.blocks": 10,
            "prefetch.bytes": 1_000_000,
            "load.bytes": 500_000,
            "prefetch.on_time": 7,
            "prefetch.late": 1,
            "prefetch.wasted": 1,
            "prefetch.superseded_by_request": 1,
            "demand_load.requests": 3,
            "tokens.from_host": 1280,
            "next_turn.prefix_tokens_recomputed": 0,
            "stalls.decision.offload": 4,
            "stalls.decision.too_short": 0,
            "errors.tick": 2,
        }
    )
    s = extension_summary(after, before)
    assert s["offload_bytes"] == 3_000_000 and s["offloaded_blocks"] == 10
    assert s["upload_bytes"] == 1_500_000
    assert s["offload_s"] == 0.0  # histogram sum unchanged between the snapshots
    assert s["prefetch_on_time"] == 6
    assert s["prefetch_on_time_rate"] == pytest.approx(6 / 9)
    assert s["demand_loads"] == 3 and s["tokens_from_host"] == 1280
    assert s["next_turn_prefix_tokens_recomputed"] == 0
    assert s["stall_decisions"] == {"offload": 4}
    assert s["errors"] == {"tick": 2}
    assert extension_summary(None) is None
    empty = extension_summary(_snapshot())
    assert (
        empty["prefetch_on_time_rate"] is None and empty["offload_bytes"] == 0 and empty["upload_bytes"] == 0
    )
    assert extension_summary({"other": 1})["offload_bytes"] is None  # not a connector snapshot


def test_stats_delta():
    assert stats_delta({"a": {"b": 1}}, {"a": {"b": 4, "c": 2}}) == {"a.b": 3.0, "a.c": 2.0}


def test_extension_summary_next_turn_share_and_readiness():
    before = _snapshot(**{"next_turn.prefix_tokens": 1000, "readiness.eligible": 2, "readiness.missed": 2})
    after = _snapshot(
        **{
            "next_turn.prefix_tokens": 5000,
            "next_turn.prefix_tokens_recomputed": 1000,
            "readiness.eligible": 12,
            "readiness.prefetched": 3,
            "readiness.not_needed": 2,
            "readiness.loading": 1,
            "readiness.missed": 6,
            "prefetch.not_needed": 5,
        }
    )
    s = extension_summary(after, before)
    # Deltas: prefix 4000 tokens of which 1000 recomputed; 10 eligible stalls, 4 of them missed.
    assert s["next_turn_recomputed_share"] == pytest.approx(0.25)
    assert (s["readiness_eligible"], s["readiness_prefetched"], s["readiness_missed"]) == (10, 3, 4)
    assert (s["readiness_not_needed"], s["readiness_loading"]) == (2, 1)
    assert s["ready_rate"] == pytest.approx((3 + 2 + 1) / 10)
    assert s["on_time_rate_excl_not_needed"] == pytest.approx((3 + 1) / (10 - 2))
    assert s["prefetch_not_needed"] == 5
    assert s["next_turn_ttft_mean_s"] is None  # no histogram yet
    hist_before = {
        **before,
        "histograms": {"next_turn.ttft_s": {"count": 2, "sum": 3.0}, "spatial.reserved_frac": {"count": 0}},
    }
    hist_after = {
        **after,
        "histograms": {
            "next_turn.ttft_s": {"count": 6, "sum": 5.0},
            "spatial.reserved_frac": {"count": 4, "sum": 0.6},
        },
    }
    hist = extension_summary(hist_after, hist_before)
    assert hist["next_turn_ttft_mean_s"] == pytest.approx(0.5)
    assert hist["reserved_frac_mean"] == pytest.approx(0.15)  # the reserve's mean share per step
    # Counters the connector has not created yet are zero; shares of nothing are None.
    empty = extension_summary(_snapshot())
    assert empty["readiness_eligible"] == 0 and empty["prefetch_not_needed"] == 0
    assert empty["ready_rate"] is None and empty["next_turn_recomputed_share"] is None
    assert empty["on_time_rate_excl_not_needed"] is None
    only_not_needed = extension_summary(_snapshot(**{"readiness.eligible": 2, "readiness.not_needed": 2}))
    assert only_not_needed["ready_rate"] == 1.0 and only_not_needed["on_time_rate_excl_not_needed"] is None
    foreign = extension_summary({"other": 1})
    assert foreign["ready_rate"] is None and foreign["readiness_eligible"] is None


def test_replicas_stats_add_counters_and_histograms_and_pool_sizes():
    def doc(n: int, secs: list[float]) -> dict:
        return {
            "counters": {"offload.blocks": n, "readiness.eligible": 1},
            "gauges": {"host_pool.free": 10},
            "histograms": {
                "offload.seconds": {
                    "count": len(secs),
                    "sum": sum(secs),
                    "min": min(secs),
                    "max": max(secs),
                    "p50": secs[0],
                }
            },
            "engine": {"device_blocks": 40, "block_bytes": 4096},
            "config": {"host_pool_blocks": 80, "policy": "tokencake"},
        }

    merged = merge_stats([doc(2, [1.0]), doc(3, [2.0, 4.0]), None])
    assert merged is not None
    assert merged["counters"] == {"offload.blocks": 5, "readiness.eligible": 2}
    assert merged["gauges"] == {"host_pool.free": 20}
    h = merged["histograms"]["offload.seconds"]
    assert (h["count"], h["sum"], h["min"], h["max"]) == (3, 7.0, 1.0, 4.0) and "p50" not in h
    assert merged["engine"] == {"device_blocks": 80, "block_bytes": 4096}  # block size is not summed
    assert merged["config"] == {"host_pool_blocks": 160, "policy": "tokencake"}
    assert (merged["replicas"], merged["replicas_answered"]) == (3, 2)
    assert extension_summary(merged)["offloaded_blocks"] == 5
    assert merge_stats([None, None]) is None
