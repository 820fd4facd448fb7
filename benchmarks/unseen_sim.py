"""The KV policies on randomly drawn workloads none of them was tuned on, in the simulator.

The bench presets are a handful of points; the product is judged on workloads nobody has seen. This
draws ``--workloads`` fan-in agent workloads at random from wide ranges — agent count and apps,
context length (log-uniform), shared system prompts, turns per agent, output length, Poisson
arrival rate, tool-time median (log-uniform) and tail (lognormal sigma up to 1.5), how wrong the
second tool's hint is (4 × too small to 4 × too large), staggered starts, and a host pool from a
quarter of the sessions' working set to twice it — on the CPU-measured model and the H200 model,
and replays each on every system. Nothing here is tuned: the ranges are fixed before any run and
the draw is seeded (``--seed``).

    python benchmarks/unseen_sim.py --out docs/bench/sim-unseen.json    # ~20 min on 2 cores

Per workload: its knobs, device pressure (working set ÷ device blocks), host pool ÷ working set,
mean app E2E of each system and TokenCake's ratios to the ideal, stock vLLM and each other policy.
The summary gives the geometric mean, median and worst of each ratio and how many workloads
TokenCake loses by more than 5 % to stock vLLM or to any other policy (``losses``), with the
workloads where it does listed so they can be replayed (``tokencake sim`` takes the same knobs).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from tokencake.sim.presets import generate
from tokencake.sim.profiles import get_profile
from tokencake.sim.run import ideal_blocks, simulate

#: The systems replayed on every workload (the bench's names; ``spatial-off`` is TokenCake's KV
#: policy under vLLM's priority order, the spatial scheduler's ablation).
SYSTEMS: tuple[str, ...] = (
    "baseline",
    "offload-all",
    "continuum",
    "infercept",
    "spatial-off",
    "tokencake",
    "ideal",
)
#: A loss bigger than this (TokenCake's mean E2E ÷ another system's) is listed.
LOSS = 1.05


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw(rng: random.Random, index: int) -> dict[str, Any]:
    """One workload's knobs: every range is fixed here, before any result is seen."""
    gpu = index % 2 == 1  # alternate the CPU-measured model and the H200 model
    if gpu:
        agents = int(_log_uniform(rng, 32, 320))
        context = int(_log_uniform(rng, 2_000, 24_000))
        rate = _log_uniform(rng, 0.2, 4.0)
    else:
        agents = int(_log_uniform(rng, 4, 40))
        context = int(_log_uniform(rng, 300, 2_400))
        rate = _log_uniform(rng, 0.03, 1.0)
    per_app = rng.randint(1, 8)
    lo = rng.randint(2, 6)
    hi = lo + rng.randint(0, 6)
    shared = int(context * rng.uniform(0.2, 1.5)) if rng.random() < 0.4 else 0
    median = _log_uniform(rng, 0.3, 20.0)
    return {
        "profile": "h200-llama3-8b" if gpu else "cpu-measured",
        "agents": agents,
        "apps": max(1, -(-agents // per_app)),
        "context_tokens": context,
        "shared_prefix_tokens": shared,
        "rate": round(rate, 4),
        "output_tokens": rng.choice((16, 24, 64, 128)),
        "mix": {
            "turns": [lo, hi],
            "tool_median_s": round(median, 3),
            "tool_sigma": round(rng.uniform(0.0, 1.5), 3),
            "tool_cap": round(rng.uniform(3.0, 10.0), 2),
            "hint_error": round(_log_uniform(rng, 0.25, 4.0), 3),
            "stagger_s": round(rng.uniform(0.0, 2.0) * min(median, 3.0), 3),
        },
        "host_fraction": round(_log_uniform(rng, 0.25, 2.0), 3),
        "seed": index,
    }


def run_one(knobs: dict[str, Any], systems: tuple[str, ...]) -> dict[str, Any]:
    profile = get_profile(knobs["profile"])
    trace = generate(
        "stress",
        agents=knobs["agents"],
        apps=knobs["apps"],
        context_tokens=knobs["context_tokens"],
        shared_prefix_tokens=knobs["shared_prefix_tokens"],
        rate=knobs["rate"],
        output_tokens=knobs["output_tokens"],
        seed=knobs["seed"],
        mix=knobs["mix"],
    )
    working = ideal_blocks(trace, profile.block_size)
    host = max(1, int(working * knobs["host_fraction"]))
    out: dict[str, Any] = {
        "knobs": knobs,
        "working_set_blocks": working,
        "device_blocks": profile.device_blocks,
        "host_blocks": host,
        "pressure": round(working / profile.device_blocks, 3),
        "systems": {},
    }
    for name in systems:
        r = simulate(trace, profile, name, host_blocks=host)
        ext = r.extension or {}
        out["systems"][name] = {
            "e2e_mean_s": r.e2e_mean_s,
            "computed_prompt_tokens": r.computed_prompt_tokens,
            "preemptions": r.preemptions,
            "next_turn_recomputed_share": ext.get("next_turn_recomputed_share"),
            # Issue 9's readiness, judged at each next request's arrival (docs/policy.md §4).
            "readiness": {k: ext.get("counters", {}).get(f"readiness.{k}", 0) for k in READINESS},
            "wall_s": round(r.wall_s, 2),
        }
    e2e = {k: v["e2e_mean_s"] for k, v in out["systems"].items()}
    if "tokencake" in e2e:
        ours = e2e["tokencake"]
        out["ratios"] = {f"tokencake/{k}": ours / v for k, v in e2e.items() if k != "tokencake" and v > 0}
    return out


#: The readiness counters kept per system: eligible stalls, the ready ones by kind, and those whose
#: next request came to a device with no room for the chain (``no_room_*``: of them, the ready ones).
READINESS: tuple[str, ...] = (
    "eligible",
    "prefetched",
    "not_needed",
    "loading",
    "no_room",
    "no_room_prefetched",
    "no_room_not_needed",
    "no_room_loading",
)


def readiness(rows: list[dict[str, Any]], system: str = "tokencake") -> dict[str, Any] | None:
    """Pooled over ``rows``: the share of eligible stalls ready at arrival, the same share over
    the stalls whose device had room for the chain, and the share that had none."""
    tot = dict.fromkeys(READINESS, 0)
    for r in rows:
        for k, v in (r["systems"].get(system, {}).get("readiness") or {}).items():
            tot[k] += v
    if not tot["eligible"]:
        return None
    ready = tot["prefetched"] + tot["not_needed"] + tot["loading"]
    ready_no_room = tot["no_room_prefetched"] + tot["no_room_not_needed"] + tot["no_room_loading"]
    with_room = tot["eligible"] - tot["no_room"]
    return {
        "eligible": tot["eligible"],
        "ready_rate": ready / tot["eligible"],
        "ready_rate_with_room": (ready - ready_no_room) / with_room if with_room else None,
        "no_room_share": tot["no_room"] / tot["eligible"],
    }


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "geomean": math.exp(statistics.fmean(math.log(v) for v in values)),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _git() -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "tokencake", "benchmarks"],
        capture_output=True,
        text=True,
        cwd=root,
        check=False,
    ).stdout.strip()
    return {"git_commit": commit, "git_dirty": bool(dirty)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = sorted({k for r in rows for k in r.get("ratios", {})})
    summary: dict[str, Any] = {"n": len(rows), "ratios": {}}
    for key in keys:
        values = [r["ratios"][key] for r in rows if key in r.get("ratios", {})]
        summary["ratios"][key] = _spread(values)
        if key != "tokencake/ideal":
            summary.setdefault("losses", {})[key] = [
                r["index"] for r in rows if r.get("ratios", {}).get(key, 0) > LOSS
            ]
    summary["loss_counts"] = {key: len(v) for key, v in summary.get("losses", {}).items()}
    for profile in sorted({r["knobs"]["profile"] for r in rows}):
        sub = [r for r in rows if r["knobs"]["profile"] == profile]
        summary.setdefault("by_profile", {})[profile] = {
            key: _spread([r["ratios"][key] for r in sub if key in r.get("ratios", {})]) for key in keys
        }
        summary.setdefault("readiness", {})[profile] = readiness(sub)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("sim-unseen.json"))
    ap.add_argument("--workloads", type=int, default=24, help="workloads to draw (default 24)")
    ap.add_argument("--seed", type=int, default=0, help="the draw's seed (default 0)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"default {','.join(SYSTEMS)}")
    ap.add_argument("--only", type=int, action="append", help="run only this workload index (repeatable)")
    args = ap.parse_args()
    systems = tuple(s for s in args.systems.split(",") if s)
    rng = random.Random(f"unseen-workloads:{args.seed}")
    drawn = [draw(rng, i) for i in range(args.workloads)]
    started = time.perf_counter()
    rows = []
    for i, knobs in enumerate(drawn):
        if args.only and i not in args.only:
            continue
        row = run_one(knobs, systems)
        row["index"] = i
        rows.append(row)
        ratios = " ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in row.get("ratios", {}).items())
        print(
            f"[{i}] {knobs['profile']} {knobs['agents']} agents, ctx {knobs['context_tokens']}, "
            f"pressure {row['pressure']:.2f}, host {knobs['host_fraction']:.2f} x ws: tokencake / {ratios}",
            flush=True,
        )
    doc = {
        "kind": "sim-unseen",
        "versions": _git(),
        "argv": {"workloads": args.workloads, "seed": args.seed, "systems": list(systems), "only": args.only},
        "wall_s": round(time.perf_counter() - started, 1),
        "rows": rows,
        "summary": summarize(rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
