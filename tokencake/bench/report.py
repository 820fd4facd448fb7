"""Turn a results dict into files: results.json, the summary and calls CSVs, summary.md and the plots.

Every function here is a pure function of the results dict (plus an output directory), so a report can
be regenerated from a stored ``results.json`` (``tokencake bench --report DIR``) and tested with fake data;
the terminal table is :func:`tokencake.bench.terminal.render`.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokencake.bench.markdown import markdown
from tokencake.bench.plots import plot_e2e_cdf, plot_kv_usage, plot_node_breakdown, plot_sweep
from tokencake.bench.tables import lookup

# ---------------------------------------------------------------------------------------------------
# Flat rows


def system_rows(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One flat row per (point, system) with the headline numbers (the summary CSV)."""
    rows = []
    for point in results["points"]:
        for name, s in point["systems"].items():
            ext = lookup(s, "extension", "summary") or {}
            hist = lookup(s, "server", "histograms") or {}
            rows.append(
                {
                    "point": point["label"],
                    "system": name,
                    "num_gpu_blocks": s.get("num_gpu_blocks"),
                    "apps": lookup(s, "client", "apps"),
                    "apps_failed": lookup(s, "client", "apps_failed"),
                    "e2e_mean_s": lookup(s, "client", "e2e_s", "mean"),
                    "e2e_p50_s": lookup(s, "client", "e2e_s", "p50"),
                    "e2e_p95_s": lookup(s, "client", "e2e_s", "p95"),
                    "e2e_p99_s": lookup(s, "client", "e2e_s", "p99"),
                    "call_latency_mean_s": lookup(s, "client", "call_latency_s", "mean"),
                    "call_latency_p95_s": lookup(s, "client", "call_latency_s", "p95"),
                    "ttft_mean_s": lookup(hist, "ttft_s", "mean"),
                    "ttft_p95_s": lookup(hist, "ttft_s", "p95"),
                    "queue_mean_s": lookup(hist, "queue_s", "mean"),
                    "prefill_mean_s": lookup(hist, "prefill_s", "mean"),
                    "prompt_tokens": lookup(s, "server", "prompt_tokens"),
                    "computed_prompt_tokens": lookup(s, "server", "computed_prompt_tokens"),
                    "cache_hit_tokens": lookup(s, "server", "prompt_tokens_by_source", "local_cache_hit"),
                    "external_kv_tokens": lookup(
                        s, "server", "prompt_tokens_by_source", "external_kv_transfer"
                    ),
                    "prefix_hit_rate": lookup(s, "server", "prefix_hit_rate"),
                    "preemptions": lookup(s, "server", "preemptions"),
                    "generation_tokens": lookup(s, "server", "generation_tokens"),
                    "kv_usage_mean": lookup(s, "kv", "mean"),
                    "kv_usage_max": lookup(s, "kv", "max"),
                    "offload_bytes": ext.get("offload_bytes"),
                    "upload_bytes": ext.get("upload_bytes"),
                    "prefetch_on_time": ext.get("prefetch_on_time"),
                    "prefetch_late": ext.get("prefetch_late"),
                    "prefetch_wasted": ext.get("prefetch_wasted"),
                    "prefetch_on_time_rate": ext.get("prefetch_on_time_rate"),
                    "prefetch_not_needed": ext.get("prefetch_not_needed"),
                    "demand_loads": ext.get("demand_loads"),
                    "next_turn_recomputed_share": ext.get("next_turn_recomputed_share"),
                    "readiness_eligible": ext.get("readiness_eligible"),
                    "readiness_missed": ext.get("readiness_missed"),
                    "ready_rate": ext.get("ready_rate"),
                    "on_time_rate_excl_not_needed": ext.get("on_time_rate_excl_not_needed"),
                    "replay_s": s.get("replay_s"),
                    "server_start_s": s.get("server_start_s"),
                    "equal_work_passed": point["equal_work"]["passed"],
                }
            )
    return rows


def call_rows(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per LLM call per system (the calls CSV)."""
    fields = (
        "key",
        "status",
        "latency_s",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "finish_reason",
    )
    rows = []
    for point in results["points"]:
        for name, s in point["systems"].items():
            for c in s["calls"]:
                rows.append({"point": point["label"], "system": name, **{f: c.get(f) for f in fields}})
    return rows


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as fh:
        if not rows:
            return
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


# ---------------------------------------------------------------------------------------------------
# Everything


def write_all(results: Mapping[str, Any], out: Path, *, plots: bool = True) -> list[Path]:
    """Write results.json, summary.csv/.md, calls.csv and the PNG plots into ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    written.append(path)
    for name, rows in (("summary.csv", system_rows(results)), ("calls.csv", call_rows(results))):
        _write_csv(out / name, rows)
        written.append(out / name)
    (out / "summary.md").write_text(markdown(results))
    written.append(out / "summary.md")
    if plots:
        for name, fn in (
            ("e2e_cdf.png", plot_e2e_cdf),
            ("kv_usage.png", plot_kv_usage),
            ("node_breakdown.png", plot_node_breakdown),
        ):
            fn(results, out / name)
            written.append(out / name)
        if len(results["points"]) > 1:
            plot_sweep(results, out / "e2e_sweep.png")
            written.append(out / "e2e_sweep.png")
    return written
