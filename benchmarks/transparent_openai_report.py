"""The numbers of ``benchmarks/transparent_openai.py``: one run's summary, the rounds pooled, the
recovered fraction with its interval, and the markdown summary. Pure functions of the recorded data."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tokencake.bench.compare import captured_fraction
from tokencake.bench.extension_stats import extension_summary, stats_delta
from tokencake.bench.intervals import mean_ci, paired_ratio_bootstrap, t_critical
from tokencake.bench.metrics import percentile, ratio, summarize
from tokencake.bench.rounds import hash_seed
from tokencake.bench.server_metrics import server_summary

#: The acceptance's bar on the recovered fraction.
TARGET = 0.8


def recovered_fraction(
    stock: Sequence[float], transparent: Sequence[float], sdk: Sequence[float]
) -> dict[str, Any]:
    """(stock - transparent) / (stock - sdk) over paired rounds, with a 95 % delta-method interval.

    The estimate is the ratio of the mean gains, ā / b̄ with a = stock - transparent and
    b = stock - sdk per round; its variance (s_a² - 2R s_ab + R² s_b²) / (n b̄²) gives a t interval
    with n - 1 degrees of freedom. ``per_round`` is each round's own fraction (None where the SDK
    path did not gain). The estimate is None when the SDK path gained nothing on average (there is
    nothing to recover); the interval needs two rounds.
    """
    if not len(stock) == len(transparent) == len(sdk):
        raise ValueError("stock, transparent and sdk need one value per round each")
    n = len(stock)
    a = [s - t for s, t in zip(stock, transparent, strict=True)]
    b = [s - k for s, k in zip(stock, sdk, strict=True)]
    out: dict[str, Any] = {
        "per_round": [captured_fraction(*v) for v in zip(stock, transparent, sdk, strict=True)],
        "n": n,
        "estimate": None,
        "ci95": None,
        "sdk_gain_s": mean_ci(b),
        "transparent_gain_s": mean_ci(a),
    }
    if not n:
        return out
    mean_a, mean_b = sum(a) / n, sum(b) / n
    if mean_b <= 0:
        return out
    r = mean_a / mean_b
    out["estimate"] = r
    if n < 2:
        return out
    var_a = sum((x - mean_a) ** 2 for x in a) / (n - 1)
    var_b = sum((y - mean_b) ** 2 for y in b) / (n - 1)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(a, b, strict=True)) / (n - 1)
    half = t_critical(n - 1) * math.sqrt(max(0.0, var_a - 2 * r * cov + r * r * var_b) / (n * mean_b**2))
    out["ci95"] = [r - half, r + half]
    return out


def summarize_run(
    makespan: float,
    agents: list[dict[str, Any]],
    calls: list[dict[str, Any]],
    metrics_before: Any,
    metrics_after: Any,
    stats_before: dict[str, Any] | None,
    stats_after: dict[str, Any] | None,
) -> dict[str, Any]:
    """One run's headline numbers beside its raw agent and call records."""
    done = [a["agent_s"] for a in agents if a["status"] == "ok"]
    server = server_summary(metrics_before, metrics_after)
    by_source = server["prompt_tokens_by_source"]
    extension = None
    if stats_after is not None:
        delta = stats_delta(stats_before, stats_after)
        extension = {
            # Every stall the connector's core saw begin (each picks a forecast source once).
            "stalls_begun": sum(v for k, v in delta.items() if k.startswith("counters.forecast.source.")),
            # stall_begin events the core received (posted or derived), and those posted over HTTP.
            "stall_begin_events": delta.get("counters.events.stall_begin", 0.0),
            "stall_begin_posted": delta.get("event_api.counters.events.stall_begin", 0.0),
            # Of those, the ones transparent mode derived from plain clients' tool-call turns.
            "stall_begin_transparent": delta.get("counters.events.transparent_begin", 0.0),
            "summary": extension_summary(stats_after, stats_before),
            "block_bytes": (stats_after.get("engine") or {}).get("block_bytes"),
        }
    return {
        "makespan_s": round(makespan, 3),
        "agent_s": {**summarize(done), "p90": percentile(done, 90)},
        "agents_failed": len(agents) - len(done),
        "http_errors": sum(1 for c in calls if c["status"] != 200),
        # vLLM's prompt tokens by source: computed (first prefill and every recomputation),
        # device prefix-cache hits, loaded from the host pool through the connector.
        "prefix_tokens": {
            "computed": by_source["local_compute"],
            "device_hits": by_source["local_cache_hit"],
            "from_host": by_source["external_kv_transfer"],
        },
        "preemptions": server["preemptions"],
        "server": server,
        "extension": extension,
        "agents": agents,
        "calls": calls,
    }


def _matched_means(runs: dict[str, dict[str, Any]], names: Sequence[str]) -> dict[str, float | None]:
    """Each system's mean agent time over the agents that finished on all ``names``."""
    ok = [{a["index"]: a["agent_s"] for a in runs[n]["agents"] if a["status"] == "ok"} for n in names]
    shared = [i for i in ok[0] if all(i in o for o in ok[1:])]
    return {
        n: (sum(o[i] for i in shared) / len(shared) if shared else None)
        for n, o in zip(names, ok, strict=True)
    }


def aggregate(rounds: list[dict[str, Any]], systems: Sequence[str]) -> dict[str, Any]:
    """Per-system series over rounds, the paired ratios and the recovered fraction."""
    complete = [r for r in rounds if all(s in r["systems"] for s in systems)]
    means = [_matched_means(r["systems"], systems) for r in complete]
    out: dict[str, Any] = {"rounds_complete": len(complete), "systems": {}, "ratios": {}}
    for s in systems:
        runs = [r["systems"][s] for r in rounds if s in r["systems"]]
        out["systems"][s] = {
            "mean_agent_s": mean_ci(m[s] for m in means),
            "p90_agent_s": mean_ci(r["agent_s"]["p90"] for r in runs),
            "makespan_s": mean_ci(r["makespan_s"] for r in runs),
            "computed_tokens": mean_ci(r["prefix_tokens"]["computed"] for r in runs),
            "from_host_tokens": mean_ci(r["prefix_tokens"]["from_host"] for r in runs),
            "stalls_begun": mean_ci((r["extension"] or {}).get("stalls_begun") for r in runs),
            "http_errors": sum(r["http_errors"] for r in runs),
            "agents_failed": sum(r["agents_failed"] for r in runs),
        }
    if "stock" not in systems:
        return out
    for s in (x for x in systems if x != "stock"):
        # (round, agent time on s, on stock) of every agent that finished on both; the bootstrap
        # resamples rounds, then agents within them (agents of one round share the machine's state).
        rows = [
            (str(r["round"]), a["agent_s"], b["agent_s"])
            for r in complete
            for a in r["systems"][s]["agents"]
            for b in r["systems"]["stock"]["agents"]
            if a["index"] == b["index"] and a["status"] == b["status"] == "ok"
        ]
        out["ratios"][f"{s}/stock"] = {
            "per_round": mean_ci(ratio(m[s], m["stock"]) for m in means),
            "by_agent": paired_ratio_bootstrap(
                [(x, y) for _r, x, y in rows], seed=hash_seed(f"{s}/stock"), clusters=[r for r, *_ in rows]
            ),
        }
    if {"transparent", "sdk"} <= set(systems) and means and all(None not in m.values() for m in means):
        rec = recovered_fraction(*([m[s] for m in means] for s in ("stock", "transparent", "sdk")))
        rec["target"] = TARGET
        rec["meets_target"] = None if rec["estimate"] is None else rec["estimate"] >= TARGET
        rec["ci_low_meets_target"] = None if rec["ci95"] is None else rec["ci95"][0] >= TARGET
        out["recovered"] = rec
    return out


def _fmt(stat: dict[str, Any] | None, digits: int = 2) -> str:
    if not stat or stat.get("mean") is None:
        return "n/a"
    text = f"{stat['mean']:.{digits}f}"
    return text + (f" ± {stat['half_width']:.{digits}f}" if stat.get("half_width") is not None else "")


def markdown(results: dict[str, Any]) -> str:
    """A short summary of a results document."""
    agg, cfg, ver = results["aggregate"], results["config"], results["versions"]
    lines = [
        "# transparent mode vs stock vs SDK path (plain openai client)",
        "",
        f"{results['started']} · {results['machine'].get('cpu_count')} CPUs · vLLM {ver.get('vllm')} · "
        f"commit {str(ver.get('git_commit'))[:10]}{' (dirty)' if ver.get('git_dirty') else ''} · "
        f"wall {results['wall_s']:.0f} s · seed {cfg['seed']}",
        "",
        f"{cfg['workload']['agents']} agents, {'-'.join(map(str, cfg['workload']['turns']))} forced tool "
        "turns + 1 answer, "
        f"lognormal tools (median {cfg['workload']['tool_median_s']} s), {cfg['device_blocks']} device "
        f"blocks, host pool {cfg['host_pool_blocks']}, {len(results['rounds'])} round(s)"
        + (" (quick)" if cfg["quick"] else ""),
        "",
        "| system | mean agent s | p90 agent s | makespan s | computed prompt tokens "
        "| tokens from host | stalls begun | HTTP errors | failed agents |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in agg["systems"].items():
        lines.append(
            f"| {name} | {_fmt(s['mean_agent_s'])} | {_fmt(s['p90_agent_s'])} | {_fmt(s['makespan_s'])} | "
            f"{_fmt(s['computed_tokens'], 0)} | {_fmt(s['from_host_tokens'], 0)} | "
            f"{_fmt(s['stalls_begun'], 1)} | {s['http_errors']} | {s['agents_failed']} |"
        )
    lines += [
        "",
        "| ratio (mean agent time) | per round | mean ± 95 % t | by agent (bootstrap) |",
        "|---|---|---|---|",
    ]
    for key, r in agg["ratios"].items():
        per = ", ".join("n/a" if v is None else f"{v:.3f}" for v in r["per_round"]["per_round"])
        boot = r["by_agent"]
        ci = boot.get("ci95")
        boot_text = "n/a" if boot.get("ratio") is None else f"{boot['ratio']:.3f}"
        boot_text += f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
        lines.append(f"| {key} | {per} | {_fmt(r['per_round'], 3)} | {boot_text} |")
    rec = agg.get("recovered")
    if rec:
        est, ci = rec["estimate"], rec["ci95"]
        lines += [
            "",
            "recovered = (stock − transparent) / (stock − sdk): "
            + ("n/a (the SDK path gained nothing)" if est is None else f"**{est:.2f}**")
            + (f" (95 % delta-method CI [{ci[0]:.2f}, {ci[1]:.2f}])" if ci else "")
            + f"; target ≥ {rec['target']:.0%}: "
            + {True: "met", False: "NOT met", None: "undecided"}[rec["meets_target"]],
        ]
        gain = rec["sdk_gain_s"]["ci95"]
        if gain is None or gain[0] <= 0:
            lines[-1] += (
                " (the SDK path's gain over stock is not told apart from 0 here: the fraction says little)"
            )
    for r in results["rounds"]:
        ew = r["equal_work"]
        lines.append(
            f"- round {r['round']}: order {' → '.join(r['order'])}, workload seed {r['seed']}, equal work "
            f"{'passed' if ew['passed'] else 'FAILED'} ({ew['output_token_mismatch_count']} output, "
            f"{ew['unexplained_prompt_mismatch_count']} unexplained prompt mismatches)"
        )
    lines += [f"- warning: {w}" for w in results["warnings"]]
    return "\n".join(lines) + "\n"
