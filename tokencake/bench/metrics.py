"""The numbers a benchmark reports, and the arithmetic behind them.

Three sources, each used for what it measures best:

* **client side** — app end-to-end latency (arrival → last node done, from the SDK's ``RunResult``) and
  per-LLM-call latency/usage (:mod:`tokencake.bench.calls`);
* **vLLM's ``/metrics``** (Prometheus text) — *deltas* over the replay of counters (prompt tokens by
  source: ``local_compute`` = recomputed/computed prefill, ``local_cache_hit``, ``external_kv_transfer``;
  prefix-cache queries/hits; preemptions) and of histograms (TTFT, queue time, prefill time), plus the
  KV-usage gauge sampled over time by :class:`KVSampler`;
* **the extension's ``/v1/stats``** JSON — offload/upload bytes and times, prefetch outcomes, demand loads
  (:func:`extension_summary`; absent for stock vLLM).

And the equal-work check (:func:`equal_work`): every system must have produced the same number of
output tokens for every call, or the latency comparison is meaningless.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokencake.serving.prometheus import Metrics, parse_metrics

# ---------------------------------------------------------------------------------------------------
# Plain statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics; None if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    data = sorted(v for v in values if v is not None and not math.isnan(v))
    if not data:
        return None
    pos = (len(data) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    """count / mean / p50 / p95 / p99 / min / max of a sample (None fields when empty)."""
    data = [float(v) for v in values if v is not None]
    mean = sum(data) / len(data) if data else None
    return {
        "count": len(data),
        "mean": mean,
        "p50": percentile(data, 50),
        "p95": percentile(data, 95),
        "p99": percentile(data, 99),
        "min": min(data) if data else None,
        "max": max(data) if data else None,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


# ---------------------------------------------------------------------------------------------------
# vLLM's /metrics (parsed by tokencake.serving.prometheus)


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


# ---------------------------------------------------------------------------------------------------
# KV usage over time


@dataclass
class KVSampler:
    """Polls ``/metrics`` in the background and keeps ``(t, kv_usage, running, waiting)`` samples.

    ``fetch`` is an async callable returning the metrics text (or parsed :data:`Metrics`, e.g.
    several replicas' merged), so tests can feed canned text.
    """

    fetch: Callable[[], Any]
    interval_s: float = 0.5
    clock: Callable[[], float] = time.time
    samples: list[dict[str, float]] = field(default_factory=list)
    errors: int = 0

    async def sample_once(self) -> None:
        try:
            text = await self.fetch()
        except Exception:  # a slow or restarting server must not kill the benchmark
            self.errors += 1
            return
        m = text if isinstance(text, dict) else parse_metrics(text)
        self.samples.append(
            {
                "t": self.clock(),
                "kv_usage": metric_value(m, "vllm:kv_cache_usage_perc"),
                "running": metric_value(m, "vllm:num_requests_running"),
                "waiting": metric_value(m, "vllm:num_requests_waiting"),
                # The spatial scheduler's critical reserve (counters; 0 without it).
                "reserved_block_steps": metric_value(m, "vllm:tokencake_spatial_reserved_block_steps_total"),
                "spatial_steps": metric_value(m, "vllm:tokencake_spatial_steps_total"),
            }
        )

    async def run(self) -> None:
        """Sample until cancelled."""
        import anyio

        while True:
            await self.sample_once()
            await anyio.sleep(self.interval_s)

    def summary(self, t0: float) -> dict[str, Any]:
        usage = [s["kv_usage"] for s in self.samples]
        reserved = reserve_series(self.samples)
        return {
            "interval_s": self.interval_s,
            "errors": self.errors,
            "mean": sum(usage) / len(usage) if usage else None,
            "max": max(usage) if usage else None,
            "max_waiting": max((s["waiting"] for s in self.samples), default=None),
            "series": [
                {
                    "t": round(s["t"] - t0, 3),
                    "kv_usage": s["kv_usage"],
                    "running": s["running"],
                    "waiting": s["waiting"],
                    **({} if r is None else {"reserved_blocks": r}),
                }
                for s, r in zip(self.samples, reserved, strict=True)
            ],
        }


def reserve_series(samples: list[dict[str, float]]) -> list[float | None]:
    """Mean device blocks in the critical reserve between each sample and the one before it.

    From the spatial scheduler's counters (blocks held for critical-path sessions summed per engine
    step, and the steps): None where no step was counted in between (idle engine, no spatial
    scheduler, or the first sample).
    """
    out: list[float | None] = [None] * len(samples)
    for i in range(1, len(samples)):
        prev, cur = samples[i - 1], samples[i]
        steps = cur.get("spatial_steps", 0.0) - prev.get("spatial_steps", 0.0)
        if steps > 0:
            held = cur.get("reserved_block_steps", 0.0) - prev.get("reserved_block_steps", 0.0)
            out[i] = round(held / steps, 3)
    return out


# ---------------------------------------------------------------------------------------------------
# Extension stats (/v1/stats of the TokenCake connector)


def flatten(data: Any, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts as ``{"a.b.c": value}`` (bools count as 0/1)."""
    out: dict[str, float] = {}
    if isinstance(data, Mapping):
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(data, bool):
        out[prefix[:-1]] = float(data)
    elif isinstance(data, int | float) and not isinstance(data, bool):
        out[prefix[:-1]] = float(data)
    return out


def _sum(flat: Mapping[str, float], *keys: str, default: float | None = None) -> float | None:
    """Sum of the given keys that exist (``default`` when none does)."""
    found = [flat[k] for k in keys if k in flat]
    return sum(found) if found else default


def extension_summary(
    after: Mapping[str, Any] | None, before: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """Headline numbers from the extension's ``/v1/stats`` JSON, as the change from ``before`` to ``after``.

    The document is the connector's ``Stats.snapshot()``: ``counters`` (``offload.bytes``,
    ``prefetch.on_time``, ``demand_load.requests``, ...) and ``histograms`` (``offload.seconds`` with
    ``sum``/``count``). Copy jobs are of three kinds: ``offload`` (device → host), ``prefetch`` and ``load``
    (demand load), both host → device. ``next_turn.*`` say how each next turn's repeated prefix was
    served; ``readiness.*`` judge, at the next request, the stalls long enough for a prefetch. A counter
    the connector has not created yet counts as 0; a field of a document without ``counters`` stays None.
    """
    if not after:
        return None
    d = stats_delta(before, after)
    # The connector creates counters on first use: absent from a real snapshot means zero.
    zero = 0.0 if isinstance(after.get("counters"), Mapping) else None

    def c(name: str) -> float | None:
        return d.get(f"counters.{name}", zero)

    on_time, late, wasted = c("prefetch.on_time"), c("prefetch.late"), c("prefetch.wasted")
    superseded, head_only = c("prefetch.superseded_by_request"), c("prefetch.head_only")
    judged = sum(x or 0.0 for x in (on_time, late, wasted, superseded, head_only))
    prefix, recomputed = c("next_turn.prefix_tokens"), c("next_turn.prefix_tokens_recomputed")
    eligible, prefetched = c("readiness.eligible"), c("readiness.prefetched")
    not_needed, loading = c("readiness.not_needed"), c("readiness.loading")
    ready = None if eligible is None else (prefetched or 0.0) + (not_needed or 0.0) + (loading or 0.0)
    no_room = c("readiness.no_room")
    return {
        "offload_bytes": c("offload.bytes"),
        "offloaded_blocks": c("offload.blocks"),
        "offload_s": d.get("histograms.offload.seconds.sum", zero),
        "upload_bytes": _sum(d, "counters.prefetch.bytes", "counters.load.bytes", default=zero),
        "uploaded_blocks": _sum(d, "counters.prefetch.blocks", "counters.load.blocks", default=zero),
        "upload_s": _sum(d, "histograms.prefetch.seconds.sum", "histograms.load.seconds.sum", default=zero),
        "prefetch_bytes": c("prefetch.bytes"),
        "prefetch_on_time": on_time,
        "prefetch_late": late,
        "prefetch_wasted": wasted,
        "prefetch_superseded": superseded,
        "prefetch_head_only": head_only,
        # Of the offloaded stalls whose next turn came, the share whose KV a prefetch had already put
        # back on device (late = copy still running, wasted = evicted again, superseded = the request
        # came before the prefetch started, so demand load served it; head only = the budget had
        # room for the chain's head only, and demand load brought the rest).
        "prefetch_on_time_rate": (on_time / judged) if on_time is not None and judged > 0 else None,
        "demand_loads": c("demand_load.requests"),
        "demand_load_blocks": c("demand_load.blocks"),
        "tokens_from_host": c("tokens.from_host"),
        "tokens_prefetched_hit": c("tokens.prefetched_hit"),
        "next_turn_prefix_tokens": c("next_turn.prefix_tokens"),
        "next_turn_prefix_tokens_device": c("next_turn.prefix_tokens_device"),
        "next_turn_prefix_tokens_host": c("next_turn.prefix_tokens_host"),
        "next_turn_prefix_tokens_recomputed": recomputed,
        # Of the prefix each agent's next turn repeated, the share the engine had to compute again.
        "next_turn_recomputed_share": _share(recomputed, prefix),
        # Mean time to first token of those next turns (arrival at the engine → first token).
        "next_turn_ttft_mean_s": _share(
            d.get("histograms.next_turn.ttft_s.sum"), d.get("histograms.next_turn.ttft_s.count")
        ),
        # Wall time of the connector's scheduler-side hooks (engine thread, between forwards).
        "connector_hook_s": c("engine.hook_seconds"),
        # Admissions of non-critical requests that evicted a critical-path session's idle KV (all;
        # and those that took a block with no host copy, which the critical path must recompute).
        "critical_inversions": c("spatial.critical_inversions"),
        "critical_inversions_unsaved": c("spatial.critical_inversions_unsaved"),
        # Those by an admission that could not wait without delaying its own app (plain,
        # re-admitted, or past its node's slack): the ones the critical reserve may not prevent.
        "critical_inversions_late": c("spatial.critical_inversions_late"),
        "critical_blocks_evicted": c("spatial.critical_blocks_evicted"),
        "critical_blocks_evicted_unsaved": c("spatial.critical_blocks_evicted_unsaved"),
        # Non-critical agent requests that waited (within their slack) rather than evict one.
        "critical_reserve_waited_requests": c("spatial.critical_reserve_waited_requests"),
        # Of the prefix the critical-path sessions' next turns repeated, the share recomputed.
        "critical_recomputed_share": _share(
            c("next_turn.critical.prefix_tokens_recomputed"), c("next_turn.critical.prefix_tokens")
        ),
        # Mean wait for admission of critical-path, other agent and plain requests (spatial order).
        **{
            f"queue_wait_{who}_mean_s": _share(
                d.get(f"histograms.queue_wait_s.{who}.sum"), d.get(f"histograms.queue_wait_s.{who}.count")
            )
            for who in ("critical", "noncritical", "plain")
        },
        # The critical reserve (spatial scheduler): mean share of device blocks held for
        # critical-path sessions per engine step, and admissions it made wait.
        "reserved_frac_mean": _share(
            d.get("histograms.spatial.reserved_frac.sum"), d.get("histograms.spatial.reserved_frac.count")
        ),
        "reserve_denials": c("spatial.reserve_denials"),
        # Agent admissions that waited a step for room kept ahead of a return (``return_reserve``).
        "return_reserve_denials": c("return_reserve.denials"),
        # Stalls longer than the transfer lead, judged at the session's next request: was its KV on
        # device (prefetched back, never evicted, or a prefetch copy in flight) or missed?
        "readiness_eligible": eligible,
        "readiness_prefetched": prefetched,
        "readiness_not_needed": not_needed,
        "readiness_loading": loading,
        "readiness_missed": c("readiness.missed"),
        "ready_rate": _share(ready, eligible),
        # Stalls whose request found no room for the chain on device (running and queued requests
        # held it: even a prefetch issued at arrival would have waited), and the ready rate of the
        # others — the stalls where being ready was possible without starving the queue.
        "readiness_no_room": no_room,
        "ready_rate_with_room": _share(
            None
            if ready is None
            else ready
            - (c("readiness.no_room_prefetched") or 0.0)
            - (c("readiness.no_room_not_needed") or 0.0)
            - (c("readiness.no_room_loading") or 0.0),
            None if eligible is None else eligible - (no_room or 0.0),
        ),
        "readiness_missed_why": {
            k[len("counters.readiness.missed_why.") :]: v
            for k, v in d.items()
            if k.startswith("counters.readiness.missed_why.") and v
        },
        # The same without the stalls that needed no prefetch: how often the prefetch itself was in time.
        "on_time_rate_excl_not_needed": _share(
            None if ready is None else ready - (not_needed or 0.0),
            None if eligible is None else eligible - (not_needed or 0.0),
        ),
        "prefetch_not_needed": c("prefetch.not_needed"),
        "stall_decisions": {
            k[len("counters.stalls.decision.") :]: v
            for k, v in d.items()
            if k.startswith("counters.stalls.decision.") and v
        },
        "copy_failures": _sum(
            d, "counters.offload.failed", "counters.prefetch.failed", "counters.load.failed", default=zero
        ),
        "errors": {
            k[len("counters.errors.") :]: v for k, v in d.items() if k.startswith("counters.errors.") and v
        },
    }


def _share(part: float | None, whole: float | None) -> float | None:
    """part / whole, or None when there is no whole to take a share of."""
    if part is None or whole is None or whole <= 0:
        return None
    return part / whole


def merge_stats(docs: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """Several replicas' ``/v1/stats`` as one document: ``counters``, ``gauges`` and
    ``histograms`` (sums and counts) add up, as do the device and host pool sizes; everything
    else is the first replica's (the same configuration everywhere). None if none answered."""
    present = [d for d in docs if d]
    if not present:
        return None
    if len(present) == 1 and len(docs) == 1:
        return dict(present[0])

    def add(a: Any, b: Any) -> Any:
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            return {k: add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {*a, *b}}
        if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
            return a + b
        return a

    def histogram(parts: list[Mapping[str, Any]]) -> dict[str, Any]:
        # count and sum add up, min and max combine; per-replica quantiles cannot be merged.
        seen = [h for h in parts if h.get("count")]
        count = sum(h["count"] for h in seen)
        if not count:
            return {"count": 0}
        total = sum(h.get("sum") or 0.0 for h in seen)
        return {
            "count": count,
            "sum": total,
            "mean": total / count,
            "min": min(h.get("min", math.inf) for h in seen),
            "max": max(h.get("max", -math.inf) for h in seen),
        }

    out = dict(present[0])
    for section in ("counters", "gauges"):
        merged: Any = {}
        for d in present:
            merged = add(merged, d.get(section) or {})
        out[section] = merged
    names = {k for d in present for k in (d.get("histograms") or {})}
    out["histograms"] = {
        k: histogram([(d.get("histograms") or {}).get(k) or {} for d in present]) for k in sorted(names)
    }
    for section, key in (("engine", "device_blocks"), ("config", "host_pool_blocks")):
        values = [(d.get(section) or {}).get(key) for d in present]
        if all(isinstance(v, int | float) for v in values) and isinstance(out.get(section), Mapping):
            out[section] = {**out[section], key: sum(values)}
    out["replicas"] = len(docs)
    out["replicas_answered"] = len(present)
    return out


def stats_delta(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> dict[str, float]:
    """Numeric leaves of ``after`` minus ``before`` (counters since the replay started)."""
    a, b = flatten(after or {}), flatten(before or {})
    return {k: v - b.get(k, 0.0) for k, v in a.items()}


# ---------------------------------------------------------------------------------------------------
# Equal-work check


@dataclass
class EqualWork:
    """Outcome of comparing per-call output token counts across systems."""

    ok: bool
    calls: int
    mismatched: list[dict[str, Any]]
    missing: list[dict[str, Any]]
    prompt_mismatched: int
    text_mismatched: int
    #: Calls whose prompt token count differs although no output they could depend on differed.
    prompt_unexplained: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.ok,
            "calls_compared": self.calls,
            "output_token_mismatches": self.mismatched[:50],
            "output_token_mismatch_count": len(self.mismatched),
            "missing_calls": self.missing[:50],
            "missing_call_count": len(self.missing),
            "prompt_token_mismatch_count": self.prompt_mismatched,
            "output_text_mismatch_count": self.text_mismatched,
            "unexplained_prompt_mismatches": self.prompt_unexplained[:50],
            "unexplained_prompt_mismatch_count": len(self.prompt_unexplained),
        }


def equal_work(calls_by_system: Mapping[str, Sequence[Mapping[str, Any]]]) -> EqualWork:
    """Compare completion tokens per call key across systems.

    The check fails when any call's output token count differs, when a call exists in one system but
    not in another (a failed request, or an app that took a different path), or when a call's prompt
    token count differs *unexplained*. Greedy outputs can differ in text between systems (batching and
    cache hits change float order), and a later prompt that contains that text differs with it: a prompt
    mismatch is explained when an earlier call of the same agent session (``run/node/n``: smaller n), or
    any call of another node of the same run (a join reads the workers' outputs), had a different output
    text. Anything else means the systems were not sent the same work.
    """
    systems = list(calls_by_system)
    tables = {s: {c["key"]: c for c in calls_by_system[s]} for s in systems}
    all_keys = sorted(set().union(*(t.keys() for t in tables.values()))) if tables else []
    mismatched: list[dict[str, Any]] = []
    missing: list[dict[str, Any]] = []
    prompt_mm = text_mm = 0
    prompt_keys: list[str] = []
    text_keys: list[str] = []
    for key in all_keys:
        present = {s: tables[s].get(key) for s in systems}
        absent = [s for s, c in present.items() if c is None]
        if absent:
            missing.append({"key": key, "missing_in": absent})
            continue
        outs = {s: c.get("completion_tokens") for s, c in present.items()}
        if len(set(outs.values())) > 1 or None in outs.values():
            mismatched.append({"key": key, "completion_tokens": outs})
        if len({c.get("prompt_tokens") for c in present.values()}) > 1:
            prompt_mm += 1
            prompt_keys.append(key)
        if len({c.get("text_sha1") for c in present.values()}) > 1:
            text_mm += 1
            text_keys.append(key)
    unexplained = [k for k in prompt_keys if not _explained(k, text_keys)]
    return EqualWork(
        ok=not mismatched and not missing and not unexplained and bool(all_keys),
        calls=len(all_keys),
        mismatched=mismatched,
        missing=missing,
        prompt_mismatched=prompt_mm,
        text_mismatched=text_mm,
        prompt_unexplained=unexplained,
    )


def _split_key(key: str) -> tuple[str, str, int] | None:
    parts = key.rsplit("/", 2)
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    return parts[0], parts[1], int(parts[2])


def _explained(key: str, text_keys: Sequence[str]) -> bool:
    """Whether a prompt mismatch at ``key`` can come from an output-text mismatch it may depend on."""
    me = _split_key(key)
    if me is None:
        return bool(text_keys)  # an unknown key format: do not fail on what we cannot attribute
    run, node, n = me
    for other in text_keys:
        it = _split_key(other)
        if it is None or it[0] != run:
            continue
        if it[1] != node or it[2] < n:
            return True
    return False


# ---------------------------------------------------------------------------------------------------
# Per-system summary from client-side records


def client_summary(apps: Sequence[Mapping[str, Any]], calls: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """App E2E and per-call latency statistics plus per-node time breakdown (mean seconds per node)."""
    ok_apps = [a for a in apps if a.get("status") == "ok"]
    per_node: dict[str, dict[str, list[float]]] = {}
    for app in ok_apps:
        for node, timing in (app.get("nodes") or {}).items():
            slot = per_node.setdefault(f"{app['app']}:{node}", {})
            for part in ("queue_s", "llm_s", "tool_s", "stall_s"):
                value = timing.get(part)
                if value is not None:
                    slot.setdefault(part, []).append(float(value))
    ok_calls = [c for c in calls if c.get("status") == 200]
    return {
        "apps": len(apps),
        "apps_failed": len(apps) - len(ok_apps),
        "e2e_s": summarize(a["e2e_s"] for a in ok_apps),
        "call_latency_s": summarize(c["latency_s"] for c in ok_calls),
        "calls": len(calls),
        "calls_failed": len(calls) - len(ok_calls),
        "prompt_tokens": sum(c.get("prompt_tokens") or 0 for c in ok_calls),
        "completion_tokens": sum(c.get("completion_tokens") or 0 for c in ok_calls),
        "cached_tokens_reported": sum(c.get("cached_tokens") or 0 for c in ok_calls),
        "node_breakdown_s": {
            node: {part: sum(vals) / len(vals) for part, vals in parts.items()}
            for node, parts in sorted(per_node.items())
        },
    }
