"""Turn a results dict into what people read: a terminal table, results.json, CSV files and PNG plots.

Every function here is a pure function of the results dict (plus an output directory), so a report can
be regenerated from a stored ``results.json`` (``tokencake bench --report DIR``) and tested with fake data.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from tokencake.bench.metrics import ratio

# ---------------------------------------------------------------------------------------------------
# Flat rows


def _get(data: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def system_rows(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One flat row per (point, system) with the headline numbers (the summary CSV)."""
    rows = []
    for point in results["points"]:
        for name, s in point["systems"].items():
            ext = _get(s, "extension", "summary") or {}
            hist = _get(s, "server", "histograms") or {}
            rows.append(
                {
                    "point": point["label"],
                    "system": name,
                    "num_gpu_blocks": s.get("num_gpu_blocks"),
                    "apps": _get(s, "client", "apps"),
                    "apps_failed": _get(s, "client", "apps_failed"),
                    "e2e_mean_s": _get(s, "client", "e2e_s", "mean"),
                    "e2e_p50_s": _get(s, "client", "e2e_s", "p50"),
                    "e2e_p95_s": _get(s, "client", "e2e_s", "p95"),
                    "e2e_p99_s": _get(s, "client", "e2e_s", "p99"),
                    "call_latency_mean_s": _get(s, "client", "call_latency_s", "mean"),
                    "call_latency_p95_s": _get(s, "client", "call_latency_s", "p95"),
                    "ttft_mean_s": _get(hist, "ttft_s", "mean"),
                    "ttft_p95_s": _get(hist, "ttft_s", "p95"),
                    "queue_mean_s": _get(hist, "queue_s", "mean"),
                    "prefill_mean_s": _get(hist, "prefill_s", "mean"),
                    "prompt_tokens": _get(s, "server", "prompt_tokens"),
                    "computed_prompt_tokens": _get(s, "server", "computed_prompt_tokens"),
                    "cache_hit_tokens": _get(s, "server", "prompt_tokens_by_source", "local_cache_hit"),
                    "external_kv_tokens": _get(
                        s, "server", "prompt_tokens_by_source", "external_kv_transfer"
                    ),
                    "prefix_hit_rate": _get(s, "server", "prefix_hit_rate"),
                    "preemptions": _get(s, "server", "preemptions"),
                    "generation_tokens": _get(s, "server", "generation_tokens"),
                    "kv_usage_mean": _get(s, "kv", "mean"),
                    "kv_usage_max": _get(s, "kv", "max"),
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
# Terminal


def _fmt(value: Any, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, int | float):
        return f"{value * scale:{spec}}{suffix}"
    return str(value)


#: (label, path into a system's results, format, scale) of the rows of the terminal table.
_TABLE_ROWS: tuple[tuple[str, tuple[str, ...], str, float], ...] = (
    ("app E2E mean (s)", ("client", "e2e_s", "mean"), ".2f", 1.0),
    ("app E2E p50 (s)", ("client", "e2e_s", "p50"), ".2f", 1.0),
    ("app E2E p95 (s)", ("client", "e2e_s", "p95"), ".2f", 1.0),
    ("app E2E p99 (s)", ("client", "e2e_s", "p99"), ".2f", 1.0),
    ("LLM call latency p50 (s)", ("client", "call_latency_s", "p50"), ".2f", 1.0),
    ("LLM call latency p95 (s)", ("client", "call_latency_s", "p95"), ".2f", 1.0),
    ("TTFT mean (s)", ("server", "histograms", "ttft_s", "mean"), ".3f", 1.0),
    ("queue time mean (s)", ("server", "histograms", "queue_s", "mean"), ".3f", 1.0),
    ("prompt tokens", ("server", "prompt_tokens"), ",.0f", 1.0),
    ("computed prompt tokens", ("server", "computed_prompt_tokens"), ",.0f", 1.0),
    ("from device prefix cache", ("server", "prompt_tokens_by_source", "local_cache_hit"), ",.0f", 1.0),
    ("from host (connector)", ("server", "prompt_tokens_by_source", "external_kv_transfer"), ",.0f", 1.0),
    ("prefix hit rate", ("server", "prefix_hit_rate"), ".0%", 1.0),
    ("preemptions", ("server", "preemptions"), ".0f", 1.0),
    ("KV usage mean", ("kv", "mean"), ".0%", 1.0),
    ("KV usage max", ("kv", "max"), ".0%", 1.0),
    ("KV in use mean (blocks)", ("kv", "mean_blocks"), ".1f", 1.0),
    ("KV in use max (blocks)", ("kv", "max_blocks"), ".0f", 1.0),
    ("device KV (blocks)", ("memory", "device_blocks"), ".0f", 1.0),
    ("host KV pool (blocks)", ("memory", "host_blocks"), ".0f", 1.0),
    ("device + host KV (MiB)", ("memory", "total_bytes"), ",.0f", 2**-20),
    ("offloaded MB", ("extension", "summary", "offload_bytes"), ".1f", 1e-6),
    ("uploaded MB", ("extension", "summary", "upload_bytes"), ".1f", 1e-6),
    ("prefetch on-time", ("extension", "summary", "prefetch_on_time"), ".0f", 1.0),
    ("prefetch late", ("extension", "summary", "prefetch_late"), ".0f", 1.0),
    ("prefetch wasted", ("extension", "summary", "prefetch_wasted"), ".0f", 1.0),
    ("prefetch on-time rate", ("extension", "summary", "prefetch_on_time_rate"), ".0%", 1.0),
    ("prefetch superseded", ("extension", "summary", "prefetch_superseded"), ".0f", 1.0),
    ("prefetch head only", ("extension", "summary", "prefetch_head_only"), ".0f", 1.0),
    ("prefetch not needed", ("extension", "summary", "prefetch_not_needed"), ".0f", 1.0),
    ("demand loads", ("extension", "summary", "demand_loads"), ".0f", 1.0),
    ("readiness: eligible stalls", ("extension", "summary", "readiness_eligible"), ".0f", 1.0),
    ("readiness: prefetched", ("extension", "summary", "readiness_prefetched"), ".0f", 1.0),
    ("readiness: not needed", ("extension", "summary", "readiness_not_needed"), ".0f", 1.0),
    ("readiness: loading", ("extension", "summary", "readiness_loading"), ".0f", 1.0),
    ("readiness: missed", ("extension", "summary", "readiness_missed"), ".0f", 1.0),
    ("ready rate", ("extension", "summary", "ready_rate"), ".0%", 1.0),
    ("readiness: no room at arrival", ("extension", "summary", "readiness_no_room"), ".0f", 1.0),
    ("ready rate where there was room", ("extension", "summary", "ready_rate_with_room"), ".0%", 1.0),
    ("on-time rate excl. not needed", ("extension", "summary", "on_time_rate_excl_not_needed"), ".0%", 1.0),
    ("next-turn prefix: device", ("extension", "summary", "next_turn_prefix_tokens_device"), ",.0f", 1.0),
    ("next-turn prefix: host", ("extension", "summary", "next_turn_prefix_tokens_host"), ",.0f", 1.0),
    (
        "next-turn prefix: recomputed",
        ("extension", "summary", "next_turn_prefix_tokens_recomputed"),
        ",.0f",
        1.0,
    ),
    ("next-turn recomputed share", ("extension", "summary", "next_turn_recomputed_share"), ".0%", 1.0),
    ("failed apps", ("client", "apps_failed"), ".0f", 1.0),
)

#: Per-round headlines of ``aggregate[point]["rounds"]``: key -> (label, format).
ROUND_HEADLINES: dict[str, tuple[str, str]] = {
    "tokencake/baseline": ("E2E mean tokencake/baseline", ".3f"),
    "tokencake/ideal": ("E2E mean tokencake/ideal", ".3f"),
    "baseline/ideal": ("E2E mean baseline/ideal", ".3f"),
    "tokencake-roomy/ideal": ("E2E mean tokencake-roomy/ideal (no pressure; target <= 1.02)", ".3f"),
    "tokencake-roomy/ideal-priority": ("E2E mean tokencake-roomy/ideal-priority (connector only)", ".3f"),
    "tokencake/baseline-priority": ("E2E mean tokencake/baseline-priority", ".3f"),
    "ideal-priority/ideal": ("E2E mean ideal-priority/ideal (priority scheduler alone)", ".3f"),
    "tokencake/offload-all": ("E2E mean tokencake/offload-all (events vs an LRU host tier)", ".3f"),
    "tokencake/continuum": ("E2E mean tokencake/continuum", ".3f"),
    "tokencake/infercept": ("E2E mean tokencake/infercept", ".3f"),
    "offload-all/ideal": ("E2E mean offload-all/ideal", ".3f"),
    "continuum/ideal": ("E2E mean continuum/ideal", ".3f"),
    "infercept/ideal": ("E2E mean infercept/ideal", ".3f"),
    "stock-connector/baseline": ("E2E mean stock-connector/baseline (connector loaded, no policy)", ".3f"),
    "tokencake/hold-off": ("E2E mean tokencake/hold-off (holding prefetched chains vs not)", ".3f"),
    "return-reserve/tokencake": ("E2E mean return-reserve/tokencake (room kept ahead of returns)", ".3f"),
    "continuum-queue/continuum": ("E2E mean continuum-queue/continuum (Continuum's queue order)", ".3f"),
    "tokencake/continuum-queue": ("E2E mean tokencake/continuum-queue", ".3f"),
    "tokencake/spatial-off": ("E2E mean tokencake/spatial-off (spatial scheduler on vs off)", ".3f"),
    "spatial-off/ideal": ("E2E mean spatial-off/ideal", ".3f"),
    "spatial-order/spatial-off": ("E2E mean spatial-order/spatial-off (the admission order alone)", ".3f"),
    "reserve-off/spatial-off": ("E2E mean reserve-off/spatial-off (order + critical-last eviction)", ".3f"),
    "tokencake/reserve-off": ("E2E mean tokencake/reserve-off (the critical reserve)", ".3f"),
    "spare-late/spatial-off": ("E2E mean spare-late/spatial-off", ".3f"),
    "spare-late/tokencake": ("E2E mean spare-late/tokencake (late admissions spare critical chains)", ".3f"),
    "reserve-head/spatial-off": ("E2E mean reserve-head/spatial-off", ".3f"),
    "reserve-head/tokencake": ("E2E mean reserve-head/tokencake (reserve wait from the queue's head)", ".3f"),
    "reserve-arrival/spatial-off": ("E2E mean reserve-arrival/spatial-off", ".3f"),
    "tokencake/reserve-arrival": (
        "E2E mean tokencake/reserve-arrival (reserve wait from the queue's head)",
        ".3f",
    ),
    "spatial-off/offload-all": ("E2E mean spatial-off/offload-all (same scheduler)", ".3f"),
    "spatial-off/continuum": ("E2E mean spatial-off/continuum (same scheduler)", ".3f"),
    "spatial-off/infercept": ("E2E mean spatial-off/infercept (same scheduler)", ".3f"),
    "replicas-affinity/replicas-round-robin": (
        "E2E mean replicas-affinity/replicas-round-robin (session affinity vs none)",
        ".3f",
    ),
    "captured_fraction": ("captured fraction (baseline - tokencake) / (baseline - ideal)", ".2f"),
    "prefetch_on_time_rate": ("prefetch on-time rate", ".2f"),
    "next_turn_recomputed_share": ("next-turn recomputed share", ".2f"),
    "ready_rate": ("ready rate", ".2f"),
    "ready_rate_with_room": ("ready rate where the device had room at arrival", ".2f"),
    "on_time_rate_excl_not_needed": ("on-time rate excl. not needed", ".2f"),
}


#: Per-system series of ``rounds`` (``"<system>:<key>"``): key -> (label, format).
SYSTEM_ROUND_ROWS: dict[str, tuple[str, str]] = {
    "e2e_mean_s": ("app E2E mean (s)", ".2f"),
    "prefix_hit_rate": ("prefix hit rate", ".3f"),
    "host_token_share": ("prompt tokens from host", ".3f"),
}


def round_rows(rounds: Mapping[str, Any]) -> list[tuple[str, tuple[str, str]]]:
    """The headline rows present in ``rounds``, then each system's own per-round rows."""
    rows = [(k, v) for k, v in ROUND_HEADLINES.items() if k in rounds]
    for key in rounds:
        name, _, stat = key.partition(":")
        if stat in SYSTEM_ROUND_ROWS:
            label, spec = SYSTEM_ROUND_ROWS[stat]
            rows.append((key, (f"{name}: {label}", spec)))
    return rows


def interval_cells(entry: Mapping[str, Any], spec: str) -> tuple[str, str, str]:
    """(per-round values, mean, 95 % CI) of one :func:`~tokencake.bench.intervals.mean_ci` entry as text."""
    per_round = ", ".join(_fmt(v, spec) for v in entry.get("per_round", []))
    ci = entry.get("ci95")
    interval = f"[{_fmt(ci[0], spec)}, {_fmt(ci[1], spec)}]" if ci else "— (needs 2 rounds)"
    return per_round, _fmt(entry.get("mean"), spec), interval


def paired_cells(paired: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(pair, "pairs (apps) | ratio | [low, high]")`` of the paired-bootstrap headlines, in headline
    order (results stored before the bootstrap resampled by app give no app count)."""
    out = []
    for key, entry in paired.items():
        ci = entry.get("ci95")
        interval = f"[{_fmt(ci[0], '.3f')}, {_fmt(ci[1], '.3f')}]" if ci else "— (needs 3 pairs)"
        apps = f" ({entry['n_apps']} apps)" if entry.get("n_apps") is not None else ""
        n = f"{entry.get('n_pairs', 0)}{apps}"
        out.append((key, f"{n} | {_fmt(entry.get('ratio'), '.3f')} | {interval}"))
    return out


def _point_headlines(comp: Mapping[str, Any]) -> list[str]:
    """Captured fraction, the no-pressure cost and the extension's next-turn/readiness shares of a point."""
    lines = []
    if comp.get("captured_fraction") is not None:
        lines.append(
            "captured fraction of the ideal's gain (baseline - tokencake) / (baseline - ideal), mean E2E: "
            + _fmt(comp["captured_fraction"], ".2f")
        )
    roomy = (comp.get("tokencake-roomy/ideal") or {}).get("mean")
    if roomy is not None:
        verdict = "within" if roomy <= 1.02 else "ABOVE"
        lines.append(
            f"E2E tokencake-roomy/ideal (extension cost without pressure): mean {roomy:.3f} "
            f"({verdict} the 1.02 target)"
        )
    shares = [
        f"{label} {_fmt(comp.get(key), '.0%')}"
        for key, label in (
            ("next_turn_recomputed_share", "next-turn recomputed share"),
            ("ready_rate", "ready rate"),
            ("ready_rate_with_room", "ready rate with room"),
            ("on_time_rate_excl_not_needed", "on-time excl. not needed"),
        )
        if comp.get(key) is not None
    ]
    if shares:
        lines.append("tokencake: " + " · ".join(shares))
    return lines


def render(results: Mapping[str, Any], console: Console | None = None) -> None:
    """Print the per-point table with the headline ratios and the equal-work verdict."""
    console = console or Console()
    for point in results["points"]:
        systems = point["systems"]
        table = Table(title=f"tokencake bench · {results['preset']} · {point['label']}", title_justify="left")
        table.add_column("metric")
        for name in systems:
            table.add_column(name, justify="right")
        pairs = [
            p for p in (("tokencake", "baseline"), ("tokencake", "ideal")) if all(x in systems for x in p)
        ]
        for a, b in pairs:
            table.add_column(f"{a}/{b}", justify="right")
        for label, path, spec, scale in _TABLE_ROWS:
            values = [_get(s, *path) for s in systems.values()]
            if all(v is None for v in values):
                continue
            cells = [_fmt(v, spec, scale) for v in values]
            for a, b in pairs:
                cells.append(_fmt(ratio(_get(systems[a], *path), _get(systems[b], *path)), ".2f"))
            table.add_row(label, *cells)
        console.print(table)
        comp = point["comparison"]
        lines = []
        for key in ("tokencake/baseline", "tokencake/ideal", "baseline/ideal"):
            if key in comp:
                r = comp[key]
                lines.append(f"E2E {key}: mean {_fmt(r['mean'], '.3f')}  p95 {_fmt(r['p95'], '.3f')}")
        for key, r in comp.items():
            if key.endswith("/baseline") and key not in ("tokencake/baseline",) and isinstance(r, Mapping):
                lines.append(f"E2E {key}: mean {_fmt(r.get('mean'), '.3f')}")
        lines += _point_headlines(comp)
        if "recomputed_tokens_avoided" in comp:
            avoid = comp.get("avoidable_recompute") or {}
            frac = avoid.get("fraction_avoided")
            lines.append(
                "recomputed prompt tokens avoided vs baseline: "
                + _fmt(comp["recomputed_tokens_avoided"], ",.0f")
                + (f" ({_fmt(frac, '.0%')} of the avoidable recompute)" if avoid else "")
            )
        if comp.get("prefetch_on_time_rate") is not None:
            lines.append(f"prefetch on-time rate: {_fmt(comp['prefetch_on_time_rate'], '.0%')}")
        ew = point["equal_work"]
        if ew["passed"]:
            lines.append(
                f"[green]equal work: PASSED[/] ({ew['calls_compared']} calls, identical output token counts)"
            )
        if lines:
            console.print("\n".join(lines))
        if not ew["passed"]:
            console.print(
                Panel(
                    f"[bold]EQUAL-WORK CHECK FAILED[/] — {ew['output_token_mismatch_count']} call(s) "
                    f"with different output token counts, {ew['missing_call_count']} call(s) missing "
                    f"in some system, {ew.get('unexplained_prompt_mismatch_count', 0)} unexplained "
                    "prompt-token mismatch(es).\n"
                    "The systems did not do the same work: these latency numbers are INVALID.",
                    style="bold red",
                )
            )
    for base, agg in (results.get("aggregate") or {}).items():
        comp = agg["comparison"]
        lines = [f"[bold]{base}: {agg['repeats']} interleaved rounds pooled[/]"]
        for name, s in agg["systems"].items():
            e2e = s["e2e_s"]
            lines.append(
                f"  {name}: E2E mean {_fmt(e2e['mean'])} s, p95 {_fmt(e2e['p95'])} s "
                f"({e2e['count']} apps), computed prompt tokens per round "
                + _fmt(s["computed_prompt_tokens"], ",.0f")
            )
        for key in ("tokencake/baseline", "tokencake/ideal", "baseline/ideal"):
            if key in comp:
                lines.append(
                    f"  E2E {key}: mean {_fmt(comp[key]['mean'], '.3f')}  p95 {_fmt(comp[key]['p95'], '.3f')}"
                )
        order = ", ".join(
            f"#{o['round']} " + ">".join(o["order"])
            for o in results.get("system_orders", [])
            if o.get("point") == base
        )
        if order:
            lines.append(f"  system order per round: {order}")
        rounds = agg.get("rounds") or {}
        if rounds:
            lines.append("  per round → mean [95 % CI, Student t over rounds]:")
        for key, (label, spec) in round_rows(rounds):
            per_round, mean, interval = interval_cells(rounds[key], spec)
            lines.append(f"  {label}: {per_round} → {mean} {interval}")
        paired = agg.get("paired") or {}
        if paired:
            lines.append("  paired by app → ratio of mean E2E [bootstrap 95 % CI]:")
            lines += [f"  {key}: {cells.replace(' | ', ' · ')}" for key, cells in paired_cells(paired)]
        console.print("\n".join(lines))
    for warning in results.get("warnings", []):
        console.print(f"[yellow]warning:[/] {warning}")
    verdict = "[green]valid[/]" if results["valid"] else "[bold red]INVALID[/]"
    console.print(f"results: {verdict} · wall {results['wall_s']:.0f} s")


# ---------------------------------------------------------------------------------------------------
# Markdown (for docs and issue notes)


def markdown(results: Mapping[str, Any]) -> str:
    """The terminal table as Markdown, one section per point, with the headline ratios."""
    out = [f"# tokencake bench · {results['preset']}", ""]
    desc = _get(results, "config", "description")
    if desc:
        out += [desc, ""]
    machine, versions = results.get("machine") or {}, results.get("versions") or {}
    out += [
        f"{results.get('started', '?')} · {machine.get('cpu_count', '?')} CPUs "
        f"({machine.get('cpu_model', '?')}) · "
        f"vLLM {versions.get('vllm', '?')} · tokencake {versions.get('tokencake', '?')} · "
        f"wall {results.get('wall_s', 0):.0f} s · {'valid' if results.get('valid') else '**INVALID**'}",
        "",
    ]
    for point in results["points"]:
        systems = point["systems"]
        pairs = [
            p for p in (("tokencake", "baseline"), ("tokencake", "ideal")) if all(x in systems for x in p)
        ]
        out.append(f"## {point['label']}")
        out.append("")
        out.append("| metric | " + " | ".join(systems) + "".join(f" | {a}/{b}" for a, b in pairs) + " |")
        out.append("|---" * (1 + len(systems) + len(pairs)) + "|")
        for label, path, spec, scale in _TABLE_ROWS:
            values = [_get(s, *path) for s in systems.values()]
            if all(v is None for v in values):
                continue
            cells = [_fmt(v, spec, scale) for v in values]
            cells += [_fmt(ratio(_get(systems[a], *path), _get(systems[b], *path)), ".2f") for a, b in pairs]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        comp, ew = point["comparison"], point["equal_work"]
        out.append("")
        for line in _point_headlines(comp):
            out.append(line[0].upper() + line[1:] + ".")
        if "recomputed_tokens_avoided" in comp:
            frac = (comp.get("avoidable_recompute") or {}).get("fraction_avoided")
            out.append(
                "Recomputed prompt tokens avoided vs baseline: "
                + _fmt(comp["recomputed_tokens_avoided"], ",.0f")
                + (f" ({_fmt(frac, '.0%')} of the avoidable recompute)." if frac is not None else ".")
            )
        out.append(
            f"Equal work: {'passed' if ew['passed'] else '**FAILED**'} "
            f"({ew['calls_compared']} calls compared)."
        )
        out.append("")
    for base, agg in (results.get("aggregate") or {}).items():
        rounds = agg.get("rounds") or {}
        if not rounds:
            continue
        out += [
            f"## {base}: {agg['repeats']} rounds",
            "",
            "Mean of the per-round values with a 95 % confidence interval (Student t, n − 1 degrees of "
            "freedom).",
            "",
            "| headline | per round | mean | 95 % CI |",
            "|---|---|---|---|",
        ]
        for key, (label, spec) in round_rows(rounds):
            out.append(f"| {label} | " + " | ".join(interval_cells(rounds[key], spec)) + " |")
        out.append("")
        paired = agg.get("paired") or {}
        if paired:
            out += [
                "Paired by app (same run id, same round), ratio of mean E2E with a percentile bootstrap "
                "95 % interval (resampling apps, then each app's rounds):",
                "",
                "| ratio | pairs (apps) | ratio of means | bootstrap 95 % CI |",
                "|---|---|---|---|",
            ]
            out += [f"| {key} | {cells} |" for key, cells in paired_cells(paired)]
            out.append("")
    for warning in results.get("warnings", []):
        out.append(f"> warning: {warning}")
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------
# Plots


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(n: int) -> tuple[int, int]:
    cols = min(n, 3)
    return (n + cols - 1) // cols, cols


def _per_point_panels(
    results: Mapping[str, Any],
    path: Path,
    draw: Callable[[Any, str, Mapping[str, Any]], None],
    *,
    xlabel: str,
    ylabel: str,
    ylim: tuple[float, float],
) -> None:
    """One panel per workload point, ``draw(ax, system_name, system)`` once per system in it."""
    plt = _plt()
    points = results["points"]
    rows, cols = _grid(len(points))
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax, point in zip(axes.flat, points, strict=False):
        for name, s in point["systems"].items():
            draw(ax, name, s)
        ax.set_title(point["label"])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(points) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_e2e_cdf(results: Mapping[str, Any], path: Path) -> None:
    """Empirical CDF of app E2E latency, one line per system, one panel per point."""

    def draw(ax: Any, name: str, s: Mapping[str, Any]) -> None:
        xs = sorted(a["e2e_s"] for a in s["apps"] if a.get("status") == "ok")
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)

    _per_point_panels(
        results, path, draw, xlabel="app E2E latency (s)", ylabel="fraction of apps", ylim=(0, 1.02)
    )


def plot_kv_usage(results: Mapping[str, Any], path: Path) -> None:
    """Device KV usage (vLLM's gauge) over the replay, one line per system, one panel per point."""

    def draw(ax: Any, name: str, s: Mapping[str, Any]) -> None:
        series = s["kv"]["series"]
        blocks = s.get("num_gpu_blocks")
        ax.plot(
            [p["t"] for p in series],
            [100 * p["kv_usage"] for p in series],
            label=f"{name} ({blocks} blocks)" if blocks else name,
        )

    _per_point_panels(
        results, path, draw, xlabel="time since replay start (s)", ylabel="device KV usage (%)", ylim=(0, 105)
    )


_PARTS = (("llm_s", "LLM"), ("tool_s", "tool (stall)"), ("queue_s", "waiting for inputs"))


def plot_node_breakdown(results: Mapping[str, Any], path: Path, max_nodes: int = 12) -> None:
    """Mean seconds per node spent in LLM calls vs tool stalls, bars per system (first point with data)."""
    plt = _plt()
    point = results["points"][0]
    systems = list(point["systems"])
    breakdown = {n: point["systems"][n]["client"]["node_breakdown_s"] for n in systems}
    totals: dict[str, float] = {}
    for table in breakdown.values():
        for node, parts in table.items():
            totals[node] = max(totals.get(node, 0.0), sum(parts.get(k, 0.0) for k, _ in _PARTS))
    nodes = sorted(totals, key=lambda n: -totals[n])[:max_nodes]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(nodes) * len(systems) + 2), 4.5))
    width = 0.8 / max(1, len(systems))
    colors = {"llm_s": "tab:blue", "tool_s": "tab:orange", "queue_s": "tab:gray"}
    hatches = ["", "//", "..", "xx", "\\\\", "oo"]
    parts = [
        (key, label)
        for key, label in _PARTS
        if any(breakdown[name].get(n, {}).get(key, 0.0) > 0.01 for name in systems for n in nodes)
    ]
    for si, name in enumerate(systems):
        bottom = [0.0] * len(nodes)
        xs = [i + si * width for i in range(len(nodes))]
        for key, label in parts:
            vals = [breakdown[name].get(n, {}).get(key, 0.0) for n in nodes]
            ax.bar(
                xs,
                vals,
                width,
                bottom=bottom,
                color=colors[key],
                hatch=hatches[si % len(hatches)],
                edgecolor="white",
                label=f"{label} · {name}",
            )
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(nodes))])
    ax.set_xticklabels(nodes, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("mean seconds per node")
    ax.set_title(f"per-node time: LLM vs tool stall ({point['label']})")
    top = max((totals[n] for n in nodes), default=1.0)
    ax.set_ylim(0, top * 1.45 if top > 0 else 1.0)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=len(systems), loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(results: Mapping[str, Any], path: Path) -> None:
    """Mean and p95 app E2E against the workload point (load sweeps only)."""
    plt = _plt()
    points = results["points"]
    labels = [p["label"] for p in points]
    systems = list(dict.fromkeys(n for p in points for n in p["systems"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in systems:
        for stat, style in (("mean", "-o"), ("p95", "--x")):
            ys = [_get(p["systems"].get(name), "client", "e2e_s", stat) for p in points]
            ax.plot(labels, [y if y is not None else float("nan") for y in ys], style, label=f"{name} {stat}")
    ax.set_xlabel("workload point")
    ax.set_ylabel("app E2E latency (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
