"""The terminal report: the per-point table with the headline ratios and the equal-work verdict."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from tokencake.bench.compare import revision_pairs
from tokencake.bench.metrics import ratio
from tokencake.bench.tables import (
    TABLE_ROWS,
    fmt,
    interval_cells,
    lookup,
    paired_cells,
    point_headlines,
    round_rows,
    source_lines,
    table_pairs,
)


def render(results: Mapping[str, Any], console: Console | None = None) -> None:
    """Print the per-point table with the headline ratios and the equal-work verdict."""
    console = console or Console()
    for point in results["points"]:
        systems = point["systems"]
        table = Table(title=f"tokencake bench · {results['preset']} · {point['label']}", title_justify="left")
        table.add_column("metric")
        for name in systems:
            table.add_column(name, justify="right")
        pairs = table_pairs(systems)
        for a, b in pairs:
            table.add_column(f"{a}/{b}", justify="right")
        for label, path, spec, scale in TABLE_ROWS:
            values = [lookup(s, *path) for s in systems.values()]
            if all(v is None for v in values):
                continue
            cells = [fmt(v, spec, scale) for v in values]
            for a, b in pairs:
                cells.append(fmt(ratio(lookup(systems[a], *path), lookup(systems[b], *path)), ".2f"))
            table.add_row(label, *cells)
        console.print(table)
        comp = point["comparison"]
        lines = []
        for key in _ratio_keys(systems):
            if key in comp:
                r = comp[key]
                lines.append(f"E2E {key}: mean {fmt(r['mean'], '.3f')}  p95 {fmt(r['p95'], '.3f')}")
        for key, r in comp.items():
            if key.endswith("/baseline") and key not in ("tokencake/baseline",) and isinstance(r, Mapping):
                lines.append(f"E2E {key}: mean {fmt(r.get('mean'), '.3f')}")
        lines += point_headlines(comp)
        if "recomputed_tokens_avoided" in comp:
            avoid = comp.get("avoidable_recompute") or {}
            frac = avoid.get("fraction_avoided")
            lines.append(
                "recomputed prompt tokens avoided vs baseline: "
                + fmt(comp["recomputed_tokens_avoided"], ",.0f")
                + (f" ({fmt(frac, '.0%')} of the avoidable recompute)" if avoid else "")
            )
        if comp.get("prefetch_on_time_rate") is not None:
            lines.append(f"prefetch on-time rate: {fmt(comp['prefetch_on_time_rate'], '.0%')}")
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
                f"  {name}: E2E mean {fmt(e2e['mean'])} s, p95 {fmt(e2e['p95'])} s "
                f"({e2e['count']} apps), computed prompt tokens per round "
                + fmt(s["computed_prompt_tokens"], ",.0f")
            )
        for key in _ratio_keys(agg["systems"]):
            if key in comp:
                lines.append(
                    f"  E2E {key}: mean {fmt(comp[key]['mean'], '.3f')}  p95 {fmt(comp[key]['p95'], '.3f')}"
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
    for line in source_lines(results):
        console.print(line, markup=False)
    for warning in results.get("warnings", []):
        console.print(f"[yellow]warning:[/] {warning}")
    verdict = "[green]valid[/]" if results["valid"] else "[bold red]INVALID[/]"
    console.print(f"results: {verdict} · wall {results['wall_s']:.0f} s")


def _ratio_keys(systems: Iterable[str]) -> list[str]:
    """The E2E ratios printed under a point: the three headlines and each ``NAME/NAME@REV``."""
    pairs = revision_pairs(systems)
    return ["tokencake/baseline", "tokencake/ideal", "baseline/ideal", *(f"{a}/{b}" for a, b in pairs)]
