import math

import anyio
import pytest

from tokencake.bench.metrics import (
    Histogram,
    KVSampler,
    client_summary,
    equal_work,
    extension_summary,
    merge_metrics,
    merge_stats,
    metric_value,
    percentile,
    server_summary,
    stats_delta,
    summarize,
)
from tokencake.serving.prometheus import parse_metrics


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


TEXT_BEFORE = """# HELP vllm:prompt_tokens_total x
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 80.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 20.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 20.0
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.4
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 2.0
"""

TEXT_AFTER = """vllm:prompt_tokens_total{engine="0",model_name="m"} 1100.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 380.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 520.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 200.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1100.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 520.0
vllm:num_preemptions_total{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="m"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 6.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 3.4
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 6.0
"""


def test_server_summary_is_a_delta():
    s = server_summary(parse_metrics(TEXT_BEFORE), parse_metrics(TEXT_AFTER))
    assert s["prompt_tokens"] == 1000
    assert s["computed_prompt_tokens"] == 300
    assert s["prompt_tokens_by_source"] == {
        "local_compute": 300,
        "local_cache_hit": 500,
        "external_kv_transfer": 200,
    }
    assert s["prefix_hit_rate"] == pytest.approx(0.5)
    assert s["preemptions"] == 3
    ttft = s["histograms"]["ttft_s"]
    assert ttft["count"] == 4 and ttft["mean"] == pytest.approx(0.75)
    # 2 of the 4 new observations are <= 0.5 s, the other 2 in (0.5, 1.0]
    assert ttft["p50"] == pytest.approx(0.5)
    assert 0.5 < ttft["p95"] <= 1.0
    assert s["histograms"]["queue_s"]["count"] == 0 and s["histograms"]["queue_s"]["mean"] is None


def test_histogram_quantile_interpolates_and_handles_inf_bucket():
    h = Histogram(buckets=[(1.0, 10.0), (2.0, 20.0), (math.inf, 20.0)], total=25.0, count=20.0)
    assert h.quantile(0.5) == pytest.approx(1.0)
    assert h.quantile(0.75) == pytest.approx(1.5)
    tail = Histogram(buckets=[(1.0, 1.0), (math.inf, 4.0)], total=9.0, count=4.0)
    assert tail.quantile(0.99) == 1.0  # beyond the last finite bound
    assert Histogram([], 0.0, 0.0).quantile(0.5) is None


def test_kv_sampler_collects_and_survives_errors():
    texts = iter(["vllm:kv_cache_usage_perc 0.25\nvllm:num_requests_waiting 2\n", None])

    async def fetch():
        t = next(texts)
        if t is None:
            raise OSError("down")
        return t

    sampler = KVSampler(fetch, interval_s=0.01, clock=iter([10.0, 11.0]).__next__)

    async def main():
        await sampler.sample_once()
        await sampler.sample_once()

    anyio.run(main)
    assert sampler.errors == 1
    s = sampler.summary(t0=9.0)
    assert s["series"] == [{"t": 1.0, "kv_usage": 0.25, "running": 0.0, "waiting": 2.0}]
    assert s["max"] == 0.25 and s["max_waiting"] == 2.0


def test_kv_sampler_turns_the_reserve_counters_into_a_series():
    def text(block_steps: float, steps: float) -> str:
        return (
            "vllm:kv_cache_usage_perc 0.5\n"
            f'vllm:tokencake_spatial_reserved_block_steps_total{{engine="0"}} {block_steps}\n'
            f'vllm:tokencake_spatial_steps_total{{engine="0"}} {steps}\n'
        )

    texts = iter([text(0, 0), text(30, 10), text(30, 10), text(50, 20)])

    async def fetch():
        return next(texts)

    sampler = KVSampler(fetch, interval_s=0.01, clock=iter([1.0, 2.0, 3.0, 4.0]).__next__)

    async def main():
        for _ in range(4):
            await sampler.sample_once()

    anyio.run(main)
    series = sampler.summary(t0=0.0)["series"]
    # 30 block-steps over 10 steps = 3 blocks; no step in between = no value; then 20 / 10 = 2.
    assert [p.get("reserved_blocks") for p in series] == [None, 3.0, None, 2.0]


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


def _calls(tokens, key_prefix="r/agent/"):
    return [
        {"key": f"{key_prefix}{i}", "completion_tokens": t, "prompt_tokens": 100, "text_sha1": "x"}
        for i, t in enumerate(tokens)
    ]


def test_equal_work_passes_on_identical_counts():
    check = equal_work(
        {"baseline": _calls([16, 16]), "tokencake": _calls([16, 16]), "ideal": _calls([16, 16])}
    )
    assert check.ok and check.calls == 2 and not check.mismatched


def test_equal_work_detects_different_output_counts():
    check = equal_work({"baseline": _calls([16, 16]), "tokencake": _calls([16, 9])})
    assert not check.ok
    assert check.mismatched == [{"key": "r/agent/1", "completion_tokens": {"baseline": 16, "tokencake": 9}}]
    assert check.to_dict()["passed"] is False


def test_equal_work_detects_missing_calls_and_counts_text_differences():
    a = _calls([16, 16, 16])
    b = _calls([16, 16])
    b[0]["text_sha1"] = "y"
    check = equal_work({"baseline": a, "tokencake": b})
    assert not check.ok
    assert check.missing == [{"key": "r/agent/2", "missing_in": ["tokencake"]}]
    assert check.text_mismatched == 1
    assert not equal_work({"baseline": [], "tokencake": []}).ok  # nothing compared is not a pass


def test_a_prompt_mismatch_passes_only_when_an_earlier_output_explains_it():
    a = _calls([16, 16, 16])
    b = _calls([16, 16, 16])
    b[1]["text_sha1"] = "y"  # turn 1's output text differs: turn 2's prompt may differ
    b[2]["prompt_tokens"] = 101
    check = equal_work({"baseline": a, "tokencake": b})
    assert check.ok and check.prompt_mismatched == 1 and check.prompt_unexplained == []
    # The same prompt difference with no output difference before it: not the same work.
    c = _calls([16, 16, 16])
    c[2]["prompt_tokens"] = 101
    bad = equal_work({"baseline": a, "tokencake": c})
    assert not bad.ok and bad.prompt_unexplained == ["r/agent/2"]
    assert bad.to_dict()["unexplained_prompt_mismatch_count"] == 1
    # A join reads the other nodes' outputs: a worker's text difference explains its prompt.
    worker = _calls([16], key_prefix="r/worker/")
    join = _calls([16], key_prefix="r/join/")
    worker2 = [dict(worker[0], text_sha1="z")]
    join2 = [dict(join[0], prompt_tokens=120)]
    assert equal_work({"a": worker + join, "b": worker2 + join2}).ok
    # ... but not across runs.
    other_run = [dict(worker2[0], key="q/worker/0")]
    assert not equal_work(
        {"a": [*worker, *join, dict(worker[0], key="q/worker/0")], "b": [*worker, *join2, *other_run]}
    ).ok


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


def test_replicas_metrics_add_up_and_kv_usage_is_their_mean():
    a = parse_metrics('vllm:prompt_tokens_total{engine="0"} 10\nvllm:kv_cache_usage_perc{engine="0"} 0.2\n')
    b = parse_metrics('vllm:prompt_tokens_total{engine="0"} 5\nvllm:kv_cache_usage_perc{engine="0"} 0.6\n')
    merged = merge_metrics([a, b])
    assert metric_value(merged, "vllm:prompt_tokens_total") == 15
    assert metric_value(merged, "vllm:prompt_tokens_total", replica="1") == 5
    assert metric_value(merged, "vllm:kv_cache_usage_perc") == pytest.approx(0.4)
    assert merge_metrics([a]) is a


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
