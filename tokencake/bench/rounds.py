"""Interleaved rounds of one workload point pooled: pooled statistics, every headline per round with
its mean and t interval, and paired-by-app ratios with a bootstrap interval."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tokencake.bench.compare import EXTENSION_HEADLINES, compare, pairs_of
from tokencake.bench.intervals import mean_ci, paired_ratio_bootstrap
from tokencake.bench.metrics import ratio, summarize


def aggregate(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the repetitions of each workload point: all apps' E2E per system and the ratios of the pooled
    statistics, plus every headline per round with its mean and 95 % confidence interval (``rounds``)."""
    out: dict[str, Any] = {}
    for base in dict.fromkeys(p.get("base_label", p["label"]) for p in points):
        rounds = [p for p in points if p.get("base_label", p["label"]) == base]
        names = list(dict.fromkeys(n for p in rounds for n in p["systems"]))
        pooled: dict[str, Any] = {}
        for name in names:
            runs = [p["systems"][name] for p in rounds if name in p["systems"]]
            pooled[name] = {
                "client": {
                    "e2e_s": summarize(a["e2e_s"] for r in runs for a in r["apps"] if a.get("status") == "ok")
                },
                "server": {
                    "computed_prompt_tokens": sum(r["server"]["computed_prompt_tokens"] for r in runs)
                    / len(runs)
                },
                "extension": None,
            }
        out[base] = {
            "repeats": len(rounds),
            "systems": {n: {"e2e_s": v["client"]["e2e_s"], **v["server"]} for n, v in pooled.items()},
            "comparison": compare(pooled),
            "tokencake/baseline_mean_per_round": [
                (p["comparison"].get("tokencake/baseline") or {}).get("mean") for p in rounds
            ],
            "rounds": per_round_intervals(rounds),
            "paired": paired_intervals(rounds),
        }
    return out


def reaggregate(results: dict[str, Any]) -> dict[str, Any]:
    """A stored run's comparisons and aggregate recomputed from its points with this code's pairs
    (:func:`~tokencake.bench.compare.pairs_of`: a pair added after the run was made); the
    measurements are untouched."""
    for p in results["points"]:
        p["comparison"] = compare(p["systems"])
    if results.get("aggregate") is not None:
        results["aggregate"] = aggregate(results["points"])
    return results


def app_pairs(rounds: list[dict[str, Any]], a: str, b: str) -> list[tuple[float, float]]:
    """(E2E on ``a``, E2E on ``b``) of every app that finished on both, matched by round and run id."""
    return [(x, y) for _app, x, y in _matched_apps(rounds, a, b)]


def _matched_apps(rounds: list[dict[str, Any]], a: str, b: str) -> list[tuple[str, float, float]]:
    """``(run id, E2E on a, E2E on b)`` of every app that finished on both, per round."""
    out: list[tuple[str, float, float]] = []
    for p in rounds:
        sa, sb = p["systems"].get(a), p["systems"].get(b)
        if not sa or not sb:
            continue
        on_b = {x.get("run_id"): x["e2e_s"] for x in sb["apps"] if x.get("status") == "ok"}
        for x in sa["apps"]:
            if x.get("status") == "ok" and x.get("run_id") in on_b:
                out.append((str(x.get("run_id")), x["e2e_s"], on_b[x["run_id"]]))
    return out


def paired_intervals(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Every headline pair's ratio of mean E2E over paired apps, with a bootstrap 95 % interval
    that resamples apps, then each app's rounds (an app's rounds replay one workload)."""
    out: dict[str, Any] = {}
    for a, b in pairs_of(_names(rounds)):
        rows = _matched_apps(rounds, a, b)
        if rows:
            out[f"{a}/{b}"] = paired_ratio_bootstrap(
                [(x, y) for _app, x, y in rows],
                seed=hash_seed(f"{a}/{b}"),
                clusters=[app for app, _x, _y in rows],
            )
    return out


def _names(rounds: list[dict[str, Any]]) -> list[str]:
    """Every system that ran in any of ``rounds``, in order of first appearance."""
    return list(dict.fromkeys(n for p in rounds for n in p["systems"]))


def hash_seed(text: str) -> int:
    """A stable seed from a string (``hash`` is salted per process)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def balanced_orders(names: Sequence[str], rounds: int, seed: str) -> list[list[str]]:
    """The run order of each of ``rounds`` rounds: rows of seeded Latin squares.

    Within every block of ``len(names)`` consecutive rounds each name runs once in each position, so a
    drift over the run (warm caches, load from elsewhere) favours no system; with fewer rounds than
    names, or a partial last block, no position holds a name twice more often than another. The same
    ``seed`` gives the same orders; different blocks use different squares.
    """
    out: list[list[str]] = []
    block = 0
    while len(out) < rounds:
        rng = random.Random(f"tokencake-round-order:{seed}:{block}")
        base = list(names)
        rng.shuffle(base)
        rows = [base[i:] + base[:i] for i in range(len(base))]
        rng.shuffle(rows)
        out.extend(rows)
        block += 1
    return out[:rounds]


def per_round_intervals(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each headline of the rounds' comparisons per round, with its mean and 95 % t interval.

    Keys: the mean-E2E ratios of the compared pairs (:func:`~tokencake.bench.compare.pairs_of`),
    ``captured_fraction`` and the extension's :data:`EXTENSION_HEADLINES`; a key is present when at
    least one round measured it.
    """
    series: dict[str, list[float | None]] = {}
    for a, b in pairs_of(_names(rounds)):
        key = f"{a}/{b}"
        series[key] = [(p["comparison"].get(key) or {}).get("mean") for p in rounds]
    for key in ("captured_fraction", *EXTENSION_HEADLINES):
        series[key] = [p["comparison"].get(key) for p in rounds]
    for name in _names(rounds):
        for key, value in SYSTEM_SERIES.items():
            series[f"{name}:{key}"] = [
                value(p["systems"][name]) if name in p["systems"] else None for p in rounds
            ]
    return {k: mean_ci(v) for k, v in series.items() if any(x is not None for x in v)}


def _host_token_share(system: Mapping[str, Any]) -> float | None:
    ext = (system.get("extension") or {}).get("summary") or {}
    return ratio(ext.get("tokens_from_host"), system["server"].get("prompt_tokens"))


def _extension_summary(key: str) -> Callable[[Mapping[str, Any]], float | None]:
    """A field of the system's extension summary (None on stock vLLM)."""
    return lambda s: ((s.get("extension") or {}).get("summary") or {}).get(key)


#: Per-system numbers given per round with their interval (``aggregate[point]["rounds"]["<system>:<key>"]``).
SYSTEM_SERIES: dict[str, Callable[[Mapping[str, Any]], float | None]] = {
    "e2e_mean_s": lambda s: s["client"]["e2e_s"].get("mean"),
    "prefix_hit_rate": lambda s: s["server"].get("prefix_hit_rate"),
    "host_token_share": _host_token_share,
    "computed_prompt_tokens": lambda s: s["server"].get("computed_prompt_tokens"),
    # The spatial scheduler's metrics (issue 12), measured by the connector on or off.
    "critical_inversions": _extension_summary("critical_inversions"),
    "critical_inversions_unsaved": _extension_summary("critical_inversions_unsaved"),
    "critical_inversions_late": _extension_summary("critical_inversions_late"),
    "critical_recomputed_share": _extension_summary("critical_recomputed_share"),
    "queue_wait_critical_mean_s": _extension_summary("queue_wait_critical_mean_s"),
    "queue_wait_noncritical_mean_s": _extension_summary("queue_wait_noncritical_mean_s"),
    "queue_wait_plain_mean_s": _extension_summary("queue_wait_plain_mean_s"),
}
