"""The release run set summarized: one small JSON per workload and the README table generated from them.

From the finished units of ``release.py`` (each a ``run_bench`` results file of one round), per
workload: the rounds pooled with the bench's own aggregation (``tokencake.bench.rounds.aggregate``),
which gives every compared pair's ratio of mean app E2E with two 95 % intervals:

* **paired by app** — a bootstrap that resamples apps, then each app's rounds (the pooled ratio);
* **round level** — Student t over the per-round ratios (df = rounds − 1): what varies from round
  to round (the machine, the order) and which the app bootstrap does not see.

A cell reports the pooled ratio with the *span* of both intervals (the lower of the two lows, the
higher of the two highs): at least as wide as the wider one, whichever side that is on.

**Captured** is the share of stock+priority's loss against the reference (``tokencake-roomy``:
TokenCake's own scheduler with device KV that never evicts) that TokenCake avoids::

    captured = (S − max(T, 1)) / (S − 1)      with S = stock+priority / reference,
                                                   T = TokenCake / reference (pooled ratios)

TokenCake's remaining loss ``max(T, 1) − 1`` is clipped at 0, so captured ≤ 100 % by construction:
reordering cannot make TokenCake capture more than the loss there is. When TokenCake is faster than
the reference (T < 1) the summary flags it (``tokencake_faster_than_reference``) and the TokenCake /
reference column shows by how much. No value when S ≤ 1 (nothing to capture). Its interval is the
round-level t interval of the per-round values (each computed the same way), widened to hold the
pooled value and clipped at 100 %.

**Ready** is the share of TokenCake's stalls long enough for a prefetch whose KV was on device when
the next turn came (prefetched back, never evicted, or a copy in flight); **recomputed** the share of
the prefix those next turns repeated that the engine computed again — both from the extension's
``/v1/stats`` counters, summed over the rounds.

Targets (:data:`TARGETS`) are judged on the reported interval: *met* (all of it on the right side),
*not established* (the value is, the interval crosses), *not met* (the value is not) and *missed*
(all of it on the wrong side). Every status but *met* is one generated line under the table, as is
every cut, unfinished unit, invalid attempt, and a serving code that is no longer HEAD's.

The tables rendered from these summaries, and the docs they fill: ``release_table.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokencake.bench.compare import captured_fraction, compare
from tokencake.bench.intervals import mean_ci
from tokencake.bench.rounds import aggregate

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "docs" / "bench"
#: Summaries go to ``RESULTS_DIR / SUBDIR``; claims markers name them relative to ``RESULTS_DIR``.
SUBDIR = "release"
SET_FILE = "set.json"

TC_REF, TC_PRIO, TC_STOCK = "tokencake/tokencake-roomy", "tokencake/baseline-priority", "tokencake/baseline"
PRIO_REF, NO_PRESSURE = "baseline-priority/tokencake-roomy", "tokencake-roomy/ideal-priority"
POLICY_PAIRS = ("tokencake/offload-all", "tokencake/continuum", "tokencake/infercept")


@dataclass(frozen=True)
class Target:
    """A number the release is judged by: ``path`` in a workload summary, ``op`` ``<=`` or ``>=``;
    judged where every system of ``needs`` ran."""

    label: str
    path: str
    op: str
    value: float
    fmt: str
    needs: tuple[str, ...]
    role: str = "pressure"

    def status(self, center: float | None, ci: Sequence[float] | None) -> str:
        if center is None:
            return "not measured"
        good = (lambda x: x <= self.value) if self.op == "<=" else (lambda x: x >= self.value)
        lo, hi = ci if ci else (center, center)
        near, far = (lo, hi) if self.op == "<=" else (hi, lo)
        if not good(center):
            return "missed" if not good(near) else "not met"
        return "met" if good(far) else "not established"


_TC, _REF, _PRIO = "tokencake", "tokencake-roomy", "baseline-priority"
TARGETS = (
    Target("TokenCake / reference ≤ 1.10", f"ratios|{TC_REF}|reported", "<=", 1.10, "pci3", (_TC, _REF)),
    Target("captured ≥ 85 %", "captured|reported", ">=", 0.85, "ci%", (_TC, _REF, _PRIO)),
    Target("ready ≥ 80 %", "readiness|pooled", ">=", 0.80, ".0%", (_TC,)),
    Target("recomputed ≤ 10 %", "recomputed|pooled", "<=", 0.10, ".0%", (_TC,)),
    Target(
        "TokenCake / stock FCFS ≤ 0.50 (the product's target)",
        f"ratios|{TC_STOCK}|reported",
        "<=",
        0.50,
        "pci3",
        (_TC, "baseline"),
    ),
    Target(
        "no-pressure cost: reference / stock+priority with its KV ≤ 1.02",
        f"ratios|{NO_PRESSURE}|reported",
        "<=",
        1.02,
        "pci3",
        (_REF, "ideal-priority"),
        role="no-pressure",
    ),
)
#: A captured fraction with no value: stock+priority was not slower than the reference.
NOTHING_TO_CAPTURE = "nothing to capture (stock+priority not slower than the reference)"


# -- per workload ------------------------------------------------------------------------------------


def reported(paired: Mapping[str, Any] | None, rounds: Mapping[str, Any] | None) -> dict[str, Any]:
    """The pooled paired ratio with the span of the paired-by-app and round-level intervals."""
    center = (paired or {}).get("ratio")
    cis = [c for c in ((paired or {}).get("ci95"), (rounds or {}).get("ci95")) if c]
    which = ["paired-by-app bootstrap"] * bool((paired or {}).get("ci95"))
    which += ["round-level t"] * bool((rounds or {}).get("ci95"))
    return {
        "ratio": center,
        "ci95": [min(c[0] for c in cis), max(c[1] for c in cis)] if cis else None,
        "interval": " and ".join(which) or None,
    }


def captured_against_reference(stock_ratio: float | None, tokencake_ratio: float | None) -> float | None:
    """(S − max(T, 1)) / (S − 1) of the ratios to the reference: ≤ 1 by construction; None when S ≤ 1."""
    if stock_ratio is None or tokencake_ratio is None:
        return None
    return captured_fraction(stock_ratio, max(tokencake_ratio, 1.0), 1.0)


def captured(ratios: Mapping[str, Any], series: Mapping[str, Any]) -> dict[str, Any] | None:
    """Captured against the reference, pooled and per round (module docstring)."""
    if TC_REF not in ratios or PRIO_REF not in ratios:
        return None
    t, s = ratios[TC_REF]["reported"]["ratio"], ratios[PRIO_REF]["reported"]["ratio"]
    stock_rounds = (series.get(PRIO_REF) or {}).get("per_round") or []
    tc_rounds = (series.get(TC_REF) or {}).get("per_round") or []
    per_round = [captured_against_reference(sr, tr) for sr, tr in zip(stock_rounds, tc_rounds, strict=True)]
    ci = mean_ci(per_round)["ci95"]
    value = captured_against_reference(s, t)
    if ci and value is not None:  # around the pooled value, never above 100 %
        ci = [min(ci[0], value), min(max(ci[1], value), 1.0)]
    return {
        "value": value,
        "per_round": per_round,
        "reported": {"mean": value, "ci95": ci if value is not None else None},
        "interval": "round-level t of the per-round values (widened to the pooled one), at most 100 %",
        "tokencake_faster_than_reference": t is not None and t < 1.0,
        "stock_priority_loss": None if s is None else s - 1.0,
    }


def pooled_share(points: Sequence[Mapping[str, Any]], parts: Sequence[str], whole: str) -> float | None:
    """Σ parts / Σ whole of the ``tokencake`` system's extension summary over the rounds."""
    num = den = 0.0
    for p in points:
        ext = ((p["systems"].get("tokencake") or {}).get("extension") or {}).get("summary") or {}
        if ext.get(whole) is None:
            continue
        num += sum(ext.get(k) or 0.0 for k in parts)
        den += ext[whole]
    return num / den if den > 0 else None


def _one(values: Sequence[Any]) -> Any:
    """The value every unit recorded, or ``{"differs": [...]}`` when they disagree."""
    distinct = [v for i, v in enumerate(values) if v not in values[:i]]
    return distinct[0] if len(distinct) == 1 else {"differs": distinct}


def provenance(units: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What ran: commits, dirtiness, versions, the CPU, and each system's served flags and blocks."""
    point = units[0]["points"][0]
    return {
        "commits": sorted(
            {u["versions"].get("git_commit") for u in units if u["versions"].get("git_commit")}
        ),
        "dirty": any(bool(u["versions"].get("git_dirty")) for u in units),
        "versions": {
            k: _one([u["versions"].get(k) for u in units]) for k in ("tokencake", "vllm", "torch", "python")
        },
        "machine": {
            k: _one([u["machine"].get(k) for u in units])
            for k in ("cpu_model", "cpu_flags", "cpu_count", "cpu_affinity", "memory_gib")
        },
        "served": {
            n: _one(
                [u["points"][0]["systems"][n].get("served") for u in units if n in u["points"][0]["systems"]]
            )
            for n in point["systems"]
        },
        "memory": {
            n: {k: s["memory"].get(k) for k in ("device_blocks", "host_blocks")}
            for n, s in point["systems"].items()
        },
        "units": [
            {
                "round": u["points"][0]["repeat"],
                "started": u["started"],
                "wall_s": u["wall_s"],
                "loadavg": [u["machine"].get("loadavg_start"), u["machine"].get("loadavg_end")],
            }
            for u in units
        ],
    }


def workload_summary(
    w: Mapping[str, Any], units: Sequence[Mapping[str, Any]], rounds: int, reference: str
) -> dict[str, Any]:
    """One workload's summary from its finished units (each one round of ``rounds``)."""
    units = sorted(units, key=lambda u: u["points"][0]["repeat"])
    # Compared with this code's pairs (the measurements are untouched).
    points = [{**u["points"][0], "comparison": compare(u["points"][0]["systems"])} for u in units]
    agg = aggregate(points)[points[0]["base_label"]]
    ratios = {
        key: {
            "paired": paired,
            "rounds": agg["rounds"].get(key),
            "reported": reported(paired, agg["rounds"].get(key)),
        }
        for key, paired in agg["paired"].items()
    }
    per_round: dict[str, Any] = {}
    for name in w["systems"]:
        runs = [p["systems"].get(name) for p in points]
        per_round[name] = {
            "e2e_mean_s": [r["client"]["e2e_s"]["mean"] if r else None for r in runs],
            "computed_prompt_tokens": [r["server"]["computed_prompt_tokens"] if r else None for r in runs],
            "preemptions": [r["server"].get("preemptions") if r else None for r in runs],
            "apps_e2e_s": [
                {str(a["run_id"]): a["e2e_s"] for a in r["apps"] if a.get("status") == "ok"} if r else None
                for r in runs
            ],
        }
    summary = {
        "kind": "tokencake-release-workload",
        "workload": w["name"],
        "title": w["title"],
        "role": w["role"],
        "argv": list(w["argv"]),
        "draw": w["draw"],
        "systems": list(w["systems"]),
        "reference": reference,
        "rounds": {"planned": rounds, "done": len(points), "which": [p["repeat"] for p in points]},
        "orders": [p["system_order"] for p in points],
        "provenance": provenance(units),
        "per_round": per_round,
        "ratios": ratios,
        "captured": captured(ratios, agg["rounds"]),
        "readiness": {
            "pooled": pooled_share(
                points,
                ("readiness_prefetched", "readiness_not_needed", "readiness_loading"),
                "readiness_eligible",
            ),
            "rounds": agg["rounds"].get("ready_rate"),
        },
        "recomputed": {
            "pooled": pooled_share(
                points, ("next_turn_prefix_tokens_recomputed",), "next_turn_prefix_tokens"
            ),
            "rounds": agg["rounds"].get("next_turn_recomputed_share"),
        },
    }
    summary["targets"] = judge(summary)
    return summary


def _walk(data: Any, path: str) -> Any:
    for part in path.split("|"):
        if not isinstance(data, Mapping) or part not in data:
            return None
        data = data[part]
    return data


def judge(summary: Mapping[str, Any]) -> dict[str, Any]:
    """Each target of the workload's role: its status (module docstring)."""
    out = {}
    for t in TARGETS:
        if t.role != summary["role"] or not set(t.needs) <= set(summary["systems"]):
            continue
        node = _walk(summary, t.path)
        center = node.get("ratio", node.get("mean")) if isinstance(node, Mapping) else node
        ci = node.get("ci95") if isinstance(node, Mapping) else None
        status = t.status(center, ci)
        if t.path.startswith("captured|") and summary["captured"] and center is None:
            status = NOTHING_TO_CAPTURE
        out[t.label] = {"status": status, "op": t.op, "target": t.value}
    return out


# -- the set -----------------------------------------------------------------------------------------


def summarize(
    manifest: Mapping[str, Any], out: Path, head: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the set's index, the workload summaries) from the manifest's finished units under ``out``."""
    rounds = manifest["plan"]["rounds"]
    summaries, all_units = [], []
    for w in manifest["workloads"]:
        files = [d["file"] for k, d in manifest["done"].items() if k.rsplit("#", 1)[0] == w["name"]]
        units = [json.loads((out / f).read_text()) for f in files]
        all_units += units
        if units:
            summaries.append(workload_summary(w, units, rounds, manifest["reference"]))
    done = {w["name"]: 0 for w in manifest["workloads"]}
    for key in manifest["done"]:
        done[key.rsplit("#", 1)[0]] += 1
    ident = manifest["identity"]
    index = {
        "kind": "tokencake-release-set",
        "identity": ident,
        "head": dict(head) if head else None,
        "serving_code_is_head": _same_serving_code(head, ident),
        "plan": manifest["plan"],
        "seeds": manifest["seeds"],
        "reference": manifest["reference"],
        "units": {
            "planned": len(manifest["units"]),
            "done": len(manifest["done"]),
            "invalid": len(manifest["attempts"]),
        },
        "workloads": [
            {
                "name": w["name"],
                "title": w["title"],
                "systems": w["systems"],
                "rounds_done": done[w["name"]],
                "rounds_planned": rounds,
            }
            for w in manifest["workloads"]
        ],
        "provenance": provenance(all_units) if all_units else None,
    }
    if index["provenance"]:
        del index["provenance"]["units"]
    return index, summaries


def _same_serving_code(head: Mapping[str, Any] | None, ident: Mapping[str, Any]) -> bool | None:
    """Whether HEAD serves the set's code: ``head["measured_changes"]`` (files the measured
    processes import that differ) when given, else the ``tokencake/`` trees are equal."""
    if head is None:
        return None
    if "measured_changes" in head:
        return not head["measured_changes"]
    return head["tokencake_tree"] == ident["tokencake_tree"]
