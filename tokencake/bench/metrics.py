"""The numbers a benchmark reports: sample statistics and the client-side summary of one replay.

Three sources, each used for what it measures best, each read by its own module:

* **client side** — app end-to-end latency (arrival → last node done, from the SDK's ``RunResult``) and
  per-LLM-call latency/usage (:mod:`tokencake.bench.calls`), summarised by :func:`client_summary`;
* **vLLM's ``/metrics``** (Prometheus text) — counter and histogram deltas over the replay
  (:mod:`tokencake.bench.server_metrics`), plus the KV-usage gauge sampled over time
  (:mod:`tokencake.bench.kv_sampler`);
* **the extension's ``/v1/stats``** JSON — offload/upload bytes and times, prefetch outcomes, demand loads
  (:mod:`tokencake.bench.extension_stats`; absent for stock vLLM).

And the equal-work check (:mod:`tokencake.bench.equal_work_check`): every system must have produced the
same number of output tokens for every call, or the latency comparison is meaningless.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


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
