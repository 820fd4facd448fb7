"""What the server did during a replay, from vLLM's ``/metrics`` (Prometheus text).

*Deltas* over the replay of counters (prompt tokens by source: ``local_compute`` = recomputed/computed
prefill, ``local_cache_hit``, ``external_kv_transfer``; prefix-cache queries/hits; preemptions) and of
histograms (TTFT, queue time, prefill time), read from the samples
:func:`tokencake.serving.prometheus.parse_metrics` returns; several replicas' samples merge into one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokencake.bench.metrics import ratio
from tokencake.serving.prometheus import Metrics

#: Gauges that are a share of one server's capacity: averaged, not summed, over replicas.
MEAN_GAUGES = ("vllm:kv_cache_usage_perc",)


def merge_metrics(parts: Sequence[Metrics]) -> Metrics:
    """Several equal servers' metrics as one (replicas behind a router): every series is kept,
    labelled with its replica, so counters, histograms and request gauges add up; the
    :data:`MEAN_GAUGES` (a share of one server's KV) become their mean over the servers."""
    if len(parts) == 1:
        return parts[0]
    out: Metrics = {}
    for i, metrics in enumerate(parts):
        for name, series in metrics.items():
            out.setdefault(name, []).extend(({**lab, "replica": str(i)}, v) for lab, v in series)
    for name in MEAN_GAUGES:
        if name in out:
            out[name] = [({}, sum(v for _lab, v in out[name]) / len(parts))]
    return out


def metric_value(metrics: Metrics, name: str, **labels: str) -> float:
    """Sum of all series of ``name`` whose labels include ``labels`` (0 when absent)."""
    return sum(v for lab, v in metrics.get(name, ()) if all(lab.get(k) == x for k, x in labels.items()))


def counter_delta(before: Metrics, after: Metrics, name: str, **labels: str) -> float:
    return metric_value(after, name, **labels) - metric_value(before, name, **labels)


@dataclass
class Histogram:
    """A Prometheus histogram (cumulative buckets) or the difference of two snapshots."""

    buckets: list[tuple[float, float]]  # (upper bound, cumulative count), sorted, ends with +Inf
    total: float
    count: float

    @classmethod
    def from_metrics(cls, metrics: Metrics, name: str) -> Histogram:
        per_le: dict[float, float] = {}
        for labels, value in metrics.get(f"{name}_bucket", ()):
            le = labels.get("le")
            if le is None:
                continue
            bound = math.inf if le in ("+Inf", "Inf") else float(le)
            per_le[bound] = per_le.get(bound, 0.0) + value
        return cls(
            buckets=sorted(per_le.items()),
            total=metric_value(metrics, f"{name}_sum"),
            count=metric_value(metrics, f"{name}_count"),
        )

    def __sub__(self, other: Histogram) -> Histogram:
        prev = dict(other.buckets)
        return Histogram(
            buckets=[(le, c - prev.get(le, 0.0)) for le, c in self.buckets],
            total=self.total - other.total,
            count=self.count - other.count,
        )

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Estimate the q-quantile (0..1) by linear interpolation inside the bucket (as PromQL does)."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        prev_le, prev_c = 0.0, 0.0
        for le, c in self.buckets:
            if c >= rank:
                if math.isinf(le):
                    return prev_le  # beyond the last finite bound: the best we can say
                if c == prev_c:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
            prev_le, prev_c = le, c
        return prev_le

    def summary(self) -> dict[str, float | None]:
        return {
            "count": self.count,
            "mean": self.mean,
            "p50": self.quantile(0.50),
            "p95": self.quantile(0.95),
            "p99": self.quantile(0.99),
        }


#: vLLM histograms worth reporting (name without the ``_bucket``/``_sum``/``_count`` suffix).
SERVER_HISTOGRAMS = {
    "ttft_s": "vllm:time_to_first_token_seconds",
    "queue_s": "vllm:request_queue_time_seconds",
    "prefill_s": "vllm:request_prefill_time_seconds",
    "decode_s": "vllm:request_decode_time_seconds",
    "request_e2e_s": "vllm:e2e_request_latency_seconds",
}

PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def server_summary(before: Metrics, after: Metrics) -> dict[str, Any]:
    """What the server did during the replay: counter and histogram deltas of vLLM's ``/metrics``."""
    by_source = {
        s: counter_delta(before, after, "vllm:prompt_tokens_by_source_total", source=s)
        for s in PROMPT_SOURCES
    }
    queries = counter_delta(before, after, "vllm:prefix_cache_queries_total")
    hits = counter_delta(before, after, "vllm:prefix_cache_hits_total")
    ext_queries = counter_delta(before, after, "vllm:external_prefix_cache_queries_total")
    ext_hits = counter_delta(before, after, "vllm:external_prefix_cache_hits_total")
    return {
        "prompt_tokens": counter_delta(before, after, "vllm:prompt_tokens_total"),
        "generation_tokens": counter_delta(before, after, "vllm:generation_tokens_total"),
        "prompt_tokens_by_source": by_source,
        # Prefill the engine actually computed: first-time prompt tokens plus every recomputation.
        "computed_prompt_tokens": by_source["local_compute"],
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_hit_rate": ratio(hits, queries),
        "external_prefix_cache_queries": ext_queries,
        "external_prefix_cache_hits": ext_hits,
        "preemptions": counter_delta(before, after, "vllm:num_preemptions_total"),
        "requests": counter_delta(before, after, "vllm:request_success_total"),
        "histograms": {
            key: (Histogram.from_metrics(after, name) - Histogram.from_metrics(before, name)).summary()
            for key, name in SERVER_HISTOGRAMS.items()
        },
    }
