"""The Markdown report (``summary.md``, for docs and issue notes): the terminal table, one section per
point, with the headline ratios and the per-round intervals."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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


def markdown(results: Mapping[str, Any]) -> str:
    """The terminal table as Markdown, one section per point, with the headline ratios."""
    out = [f"# tokencake bench · {results['preset']}", ""]
    desc = lookup(results, "config", "description")
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
    sources = source_lines(results)
    if sources:
        out += [f"- {line}" for line in sources] + [""]
    for point in results["points"]:
        systems = point["systems"]
        pairs = table_pairs(systems)
        out.append(f"## {point['label']}")
        out.append("")
        out.append("| metric | " + " | ".join(systems) + "".join(f" | {a}/{b}" for a, b in pairs) + " |")
        out.append("|---" * (1 + len(systems) + len(pairs)) + "|")
        for label, path, spec, scale in TABLE_ROWS:
            values = [lookup(s, *path) for s in systems.values()]
            if all(v is None for v in values):
                continue
            cells = [fmt(v, spec, scale) for v in values]
            cells += [
                fmt(ratio(lookup(systems[a], *path), lookup(systems[b], *path)), ".2f") for a, b in pairs
            ]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        comp, ew = point["comparison"], point["equal_work"]
        out.append("")
        for line in point_headlines(comp):
            out.append(line[0].upper() + line[1:] + ".")
        if "recomputed_tokens_avoided" in comp:
            frac = (comp.get("avoidable_recompute") or {}).get("fraction_avoided")
            out.append(
                "Recomputed prompt tokens avoided vs baseline: "
                + fmt(comp["recomputed_tokens_avoided"], ",.0f")
                + (f" ({fmt(frac, '.0%')} of the avoidable recompute)." if frac is not None else ".")
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
