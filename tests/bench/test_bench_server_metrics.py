"""vLLM's /metrics over a replay: counter and histogram deltas, several replicas merged."""

import math

import pytest

from tokencake.bench.server_metrics import Histogram, merge_metrics, metric_value, server_summary
from tokencake.serving.prometheus import parse_metrics

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


def test_replicas_metrics_add_up_and_kv_usage_is_their_mean():
    a = parse_metrics('vllm:prompt_tokens_total{engine="0"} 10\nvllm:kv_cache_usage_perc{engine="0"} 0.2\n')
    b = parse_metrics('vllm:prompt_tokens_total{engine="0"} 5\nvllm:kv_cache_usage_perc{engine="0"} 0.6\n')
    merged = merge_metrics([a, b])
    assert metric_value(merged, "vllm:prompt_tokens_total") == 15
    assert metric_value(merged, "vllm:prompt_tokens_total", replica="1") == 5
    assert metric_value(merged, "vllm:kv_cache_usage_perc") == pytest.approx(0.4)
    assert merge_metrics([a]) is a
