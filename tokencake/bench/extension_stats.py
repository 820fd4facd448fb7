"""The extension's ``/v1/stats`` (the TokenCake connector's counters): headline numbers of a replay as
the change over it, and several replicas' documents merged into one."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


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
