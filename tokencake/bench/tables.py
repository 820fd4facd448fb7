"""What a report's tables show and how numbers are written: shared by the terminal and Markdown reports."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from tokencake.bench.compare import revision_pairs


def lookup(data: Any, *path: str) -> Any:
    """``data[path[0]][path[1]]...``, or None where a step is missing or not a mapping."""
    for key in path:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def fmt(value: Any, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    """A number times ``scale`` in format ``spec`` plus ``suffix``; "—" for None or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, int | float):
        return f"{value * scale:{spec}}{suffix}"
    return str(value)


#: (label, path into a system's results, format, scale) of the rows of the per-point tables.
TABLE_ROWS: tuple[tuple[str, tuple[str, ...], str, float], ...] = (
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


def table_pairs(names: Iterable[str]) -> list[tuple[str, str]]:
    """The ratio columns of a point's table among systems ``names``: tokencake over baseline and over
    the ideal, and each ``NAME@REV`` system's running-code NAME over it (``revision_pairs``)."""
    names = list(names)
    fixed = [p for p in (("tokencake", "baseline"), ("tokencake", "ideal")) if all(x in names for x in p)]
    return fixed + revision_pairs(names)


def source_lines(results: Mapping[str, Any]) -> list[str]:
    """One line per ``NAME@REV`` system: the commit its server imported tokencake from, against the
    running code's (launcher, flags, workload, client), and how its server's start differed."""
    running = lookup(results, "versions", "git_commit") or "?"
    lines = []
    for name, src in (results.get("sources") or {}).items():
        line = (
            f"{name}: server code of commit {src.get('commit')}; launcher, flags, workload and client "
            f"of the running code ({running})"
        )
        diffs = src.get("server_differences") or []
        lines.append(line + ("; started with " + "; ".join(diffs) if diffs else "; the same server flags"))
    return lines


def revision_label(key: str) -> str:
    """The label of a ``NAME/NAME@REV`` per-round headline."""
    return f"E2E mean {key} (running code / revision {key.partition('@')[2]})"


def round_rows(rounds: Mapping[str, Any]) -> list[tuple[str, tuple[str, str]]]:
    """The headline rows present in ``rounds``, the ``NAME/NAME@REV`` ones, then each system's own
    per-round rows."""
    rows = [(k, v) for k, v in ROUND_HEADLINES.items() if k in rounds]
    rows += [(k, (revision_label(k), ".3f")) for k in rounds if "@" in k and ":" not in k]
    for key in rounds:
        name, _, stat = key.partition(":")
        if stat in SYSTEM_ROUND_ROWS:
            label, spec = SYSTEM_ROUND_ROWS[stat]
            rows.append((key, (f"{name}: {label}", spec)))
    return rows


def interval_cells(entry: Mapping[str, Any], spec: str) -> tuple[str, str, str]:
    """(per-round values, mean, 95 % CI) of one :func:`~tokencake.bench.intervals.mean_ci` entry as text."""
    per_round = ", ".join(fmt(v, spec) for v in entry.get("per_round", []))
    ci = entry.get("ci95")
    interval = f"[{fmt(ci[0], spec)}, {fmt(ci[1], spec)}]" if ci else "— (needs 2 rounds)"
    return per_round, fmt(entry.get("mean"), spec), interval


def paired_cells(paired: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(pair, "pairs (apps) | ratio | [low, high]")`` of the paired-bootstrap headlines, in headline
    order (results stored before the bootstrap resampled by app give no app count)."""
    out = []
    for key, entry in paired.items():
        ci = entry.get("ci95")
        interval = f"[{fmt(ci[0], '.3f')}, {fmt(ci[1], '.3f')}]" if ci else "— (needs 3 pairs)"
        apps = f" ({entry['n_apps']} apps)" if entry.get("n_apps") is not None else ""
        n = f"{entry.get('n_pairs', 0)}{apps}"
        out.append((key, f"{n} | {fmt(entry.get('ratio'), '.3f')} | {interval}"))
    return out


def point_headlines(comp: Mapping[str, Any]) -> list[str]:
    """Captured fraction, the no-pressure cost and the extension's next-turn/readiness shares of a point."""
    lines = []
    if comp.get("captured_fraction") is not None:
        lines.append(
            "captured fraction of the ideal's gain (baseline - tokencake) / (baseline - ideal), mean E2E: "
            + fmt(comp["captured_fraction"], ".2f")
        )
    roomy = (comp.get("tokencake-roomy/ideal") or {}).get("mean")
    if roomy is not None:
        verdict = "within" if roomy <= 1.02 else "ABOVE"
        lines.append(
            f"E2E tokencake-roomy/ideal (extension cost without pressure): mean {roomy:.3f} "
            f"({verdict} the 1.02 target)"
        )
    shares = [
        f"{label} {fmt(comp.get(key), '.0%')}"
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
