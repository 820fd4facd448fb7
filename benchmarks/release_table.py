"""The release set's tables, rendered from its summaries (``release_report.py``) into the docs.

A doc holds one block between :data:`OPEN` (or :data:`OPEN_BRIEF`) and :data:`CLOSE`. :data:`OPEN`
gets the full table (:func:`table`): every compared pair, the other policies, the no-pressure cost,
the fresh draws' seeds and one line per unmet target with its value, per cut and per gap.
:data:`OPEN_BRIEF` gets the brief one (:func:`brief_table`), small enough for the README: the main
ratios, captured, ready and recomputed, and the unmet targets by status and workload without their
numbers. Cells are claims markers (``tokencake.bench.claims``), so ``claims --check`` keeps both
honest.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from release_report import (  # type: ignore[import-not-found]
    NO_PRESSURE,
    NOTHING_TO_CAPTURE,
    POLICY_PAIRS,
    RESULTS_DIR,
    ROOT,
    SET_FILE,
    SUBDIR,
    TARGETS,
    TC_PRIO,
    TC_REF,
    TC_STOCK,
    summarize,
)

from tokencake.bench.claims import render

OPEN, CLOSE = "<!-- release-table -->", "<!-- /release-table -->"
#: Opens a block that gets :func:`brief_table` instead of :func:`table`.
OPEN_BRIEF = "<!-- release-table brief -->"
DOCS = (ROOT / "README.md", ROOT / "docs" / "benchmarks.md")


def _m(file: str, path: str, fmt: str) -> str:
    """A claims marker; :func:`tokencake.bench.claims.render` fills its value."""
    return f"<!--bench {SUBDIR}/{file} {path} {fmt}-->?<!--/bench-->"


def _cell(x: Mapping[str, Any], key: str) -> str:
    """A ratio's cell of workload summary ``x``: the reported ratio and interval, or — if not run."""
    return _m(f"{x['workload']}.json", f"ratios|{key}|reported", "pci3") if key in x["ratios"] else "—"


def _captured(x: Mapping[str, Any]) -> str:
    """Workload summary ``x``'s captured cell, or — where there was nothing to capture."""
    has = (x["captured"] or {}).get("value") is not None
    return _m(f"{x['workload']}.json", "captured|reported", "ci%") if has else "—"


def _share(x: Mapping[str, Any], key: str) -> str:
    return _m(f"{x['workload']}.json", f"{key}|pooled", ".0%") if x[key]["pooled"] is not None else "—"


LEGEND = (
    "Ratios of mean app E2E (lower is better), 95 % intervals spanning the paired-by-app bootstrap and "
    "the round-level t interval. Reference: `tokencake-roomy`, TokenCake's own scheduler with device KV "
    "that never evicts; stock+priority: stock vLLM with `--scheduling-policy priority`; stock: stock "
    "vLLM FCFS. Captured: the share of stock+priority's loss against the reference that TokenCake "
    "avoids, its remaining loss clipped at 0 (≤ 100 %; TokenCake / reference < 1 says it was faster). "
    "Ready: stalls whose KV was on device at the next turn; recomputed: the share of the resumed prefix "
    "computed again."
)


def table(index: Mapping[str, Any], summaries: Sequence[Mapping[str, Any]]) -> str:
    """The block between the release-table markers, with claims markers not yet rendered."""
    head = (
        f"Release run set (`benchmarks/release.sh`, plan {_m(SET_FILE, 'plan|name', 's')}): serving code "
        f"{_m(SET_FILE, 'identity|commit', '.7s')}, {_m(SET_FILE, 'units|done', 'd')} of "
        f"{_m(SET_FILE, 'units|planned', 'd')} units (one round of one workload: every system on a fresh "
        "server, in a balanced order)"
    )
    if index.get("provenance"):
        head += (
            f"; vLLM {_m(SET_FILE, 'provenance|versions|vllm', 's')}, torch "
            f"{_m(SET_FILE, 'provenance|versions|torch', 's')}, "
            f"{_m(SET_FILE, 'provenance|machine|cpu_model', 's')}"
        )
    lines = [
        head + ".",
        LEGEND,
        "",
        "| workload | rounds | TokenCake / reference | TokenCake / stock+priority | TokenCake / stock "
        "| captured | ready | recomputed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    pressure = [x for x in summaries if x["role"] == "pressure"]
    for x in pressure:
        f = f"{x['workload']}.json"
        lines.append(
            f"| {x['workload']} | {_m(f, 'rounds|done', 'd')} | {_cell(x, TC_REF)} | {_cell(x, TC_PRIO)} "
            f"| {_cell(x, TC_STOCK)} | {_captured(x)} | {_share(x, 'readiness')} "
            f"| {_share(x, 'recomputed')} |"
        )
    with_policies = [x for x in pressure if any(k in x["ratios"] for k in POLICY_PAIRS)]
    if with_policies:
        names = " | ".join(k.split("/")[1] for k in POLICY_PAIRS)
        lines += ["", f"| TokenCake / | {names} |", "|---" * (1 + len(POLICY_PAIRS)) + "|"]
        for x in with_policies:
            lines.append(f"| {x['workload']} | " + " | ".join(_cell(x, k) for k in POLICY_PAIRS) + " |")
    lines.append("")
    for x in summaries:
        if x["role"] == "no-pressure" and NO_PRESSURE in x["ratios"]:
            lines.append(
                f"No-pressure cost ({x['title']}): reference / stock+priority with the same KV "
                f"{_cell(x, NO_PRESSURE)} over {_m(x['workload'] + '.json', 'rounds|done', 'd')} rounds."
            )
    draws = [
        f"{x['workload']} seed {_m(x['workload'] + '.json', 'draw|seed', 'd')}"
        for x in summaries
        if x["draw"]
    ]
    if draws:
        lines.append(
            f"Fresh draws (`benchmarks/unseen_real.py`, seeds drawn for this set): {', '.join(draws)}."
        )
    lines += ["", "Not met, not established or not measured:", ""]
    lines += [f"- {item}" for item in not_met(index, summaries)]
    return "\n".join(lines)


BRIEF_LEGEND = (
    "Ratios of mean app E2E, lower is better [95 %: by-app bootstrap and per-round t]. Reference: "
    "TokenCake's own scheduler with device KV that never evicts; stock: stock vLLM, FCFS or with "
    "priority scheduling. Captured: the share of stock+priority's loss against the reference that "
    "TokenCake avoids (≤ 100 %). Ready: stalls whose KV was on device at the next turn; recomputed: "
    "the share of resumed prefixes computed again."
)


def brief_table(index: Mapping[str, Any], summaries: Sequence[Mapping[str, Any]]) -> str:
    """The README's block: :func:`table`'s main columns, the no-pressure cost and every unmet target
    by status and workload; the numbers of what is not met, the other policies, the seeds, the cuts
    and the provenance stay in the full table."""
    lines = [
        f"Release run set at serving code {_m(SET_FILE, 'identity|commit', '.7s')}: "
        f"{_m(SET_FILE, 'units|done', 'd')} of {_m(SET_FILE, 'units|planned', 'd')} units "
        "(`benchmarks/release.sh`; provenance, other policies, seeds and cuts in `docs/benchmarks.md`).",
        BRIEF_LEGEND,
        "",
        "| workload | / reference | / stock+priority | / stock | captured | ready | recomputed |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in summaries:
        if x["role"] != "pressure":
            continue
        lines.append(
            f"| {x['workload']} | {_cell(x, TC_REF)} | {_cell(x, TC_PRIO)} | {_cell(x, TC_STOCK)} "
            f"| {_captured(x)} | {_share(x, 'readiness')} | {_share(x, 'recomputed')} |"
        )
    lines.append("")
    for x in summaries:
        if x["role"] == "no-pressure" and NO_PRESSURE in x["ratios"]:
            lines.append(
                f"No-pressure cost, reference / stock+priority with the same KV: {_cell(x, NO_PRESSURE)}."
            )
    missing = unmet_targets(summaries, numbers=False) + _gaps(index)
    if missing:
        lines += ["", "Not met or not established:", ""]
        lines += [f"- {item}" for item in missing]
    return "\n".join(lines)


def unmet_targets(summaries: Sequence[Mapping[str, Any]], *, numbers: bool = True) -> list[str]:
    """One line per target that some workload does not meet: its status per workload, each with its
    value and interval when ``numbers``."""
    out = []
    for t in TARGETS:
        by_status: dict[str, list[str]] = {}
        for x in summaries:
            got = x["targets"].get(t.label)
            if got and got["status"] != "met":
                quoted = numbers and got["status"] not in ("not measured", NOTHING_TO_CAPTURE)
                cell = _m(f"{x['workload']}.json", t.path, t.fmt) if quoted else ""
                by_status.setdefault(got["status"], []).append(f"{x['workload']} {cell}".strip())
        if by_status:
            parts = [f"{status} on {', '.join(names)}" for status, names in by_status.items()]
            out.append(f"{t.label}: " + "; ".join(parts) + ".")
    return out


def _gaps(index: Mapping[str, Any]) -> list[str]:
    """What makes the set unfinished or not HEAD's: rounds not done, a changed or dirty serving code."""
    out = []
    short = [
        f"{w['name']} ({w['rounds_done']}/{w['rounds_planned']})"
        for w in index["workloads"]
        if w["rounds_done"] < w["rounds_planned"]
    ]
    if short:
        out.append(f"Not finished: {', '.join(short)} rounds done.")
    if index.get("serving_code_is_head") is False:
        out.append(
            "The set's serving code (`tokencake/` tree) is not HEAD's: these numbers are of an older code."
        )
    if (index.get("provenance") or {}).get("dirty"):
        out.append("A unit ran with uncommitted changes in `tokencake/`.")
    return out


def not_met(index: Mapping[str, Any], summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per target that some workload does not meet, then the set's cuts and gaps."""
    out = unmet_targets(summaries)
    plan = index["plan"]
    out += [f"Cut from the full set (time): {c}." for c in plan["cut"]]
    out.append(
        "Not in the set: "
        + ", ".join(f"the `{name}` preset ({why})" for name, why in plan["not_in_set"].items())
        + "."
    )
    if index["units"]["invalid"]:
        out.append(
            f"{index['units']['invalid']} unit run(s) were not valid and ran again (manifest `attempts`)."
        )
    return out + _gaps(index)


_BLOCK = re.compile(f"({re.escape(OPEN)}|{re.escape(OPEN_BRIEF)}).*?{re.escape(CLOSE)}", re.S)


def block_style(text: str) -> str:
    """``"brief"`` or ``"full"``: which table ``text``'s one release-table block takes."""
    found = _BLOCK.findall(text)
    if len(found) != 1:
        raise ValueError(f"want exactly one {OPEN} (or {OPEN_BRIEF}) … {CLOSE} block")
    return "brief" if found[0] == OPEN_BRIEF else "full"


def fill(text: str, block: str) -> str:
    """``text`` with everything between the release-table markers replaced by ``block`` (the
    opening marker kept)."""
    block_style(text)
    return _BLOCK.sub(lambda m: f"{m.group(1)}\n{block}\n{CLOSE}", text)


def write_all(
    manifest: Mapping[str, Any],
    out: Path,
    *,
    docs: Sequence[Path] | None = None,
    strict: bool = False,
    results_dir: Path = RESULTS_DIR,
    head: Mapping[str, Any] | None = None,
) -> list[str]:
    """Write the summaries under ``results_dir / SUBDIR`` and fill the table in ``docs`` (default
    :data:`DOCS`; a file without the markers is a ValueError when ``strict``, else skipped);
    ``head``: the checkout's serving-code identity now. Returns what it did, one line each."""
    index, summaries = summarize(manifest, out, head)
    dest = results_dir / SUBDIR
    dest.mkdir(parents=True, exist_ok=True)
    done = []
    for name, data in [(SET_FILE, index), *((f"{x['workload']}.json", x) for x in summaries)]:
        (dest / name).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
        done.append(f"wrote {dest / name}")
    blocks = {
        "full": render(table(index, summaries), results_dir, where="release table"),
        "brief": render(brief_table(index, summaries), results_dir, where="release table"),
    }
    for path in docs if docs is not None else DOCS:
        text = path.read_text()
        try:
            new = fill(text, blocks[block_style(text)])
        except ValueError as exc:
            if strict:
                raise ValueError(f"{path}: {exc}") from None
            done.append(f"skipped {path}: {exc}")
            continue
        if new != text:
            path.write_text(new)
        done.append(f"{'updated' if new != text else 'unchanged'} {path}")
    return done
