"""What the extension costs when there is no KV pressure, measured paired instead of round by round.

``tokencake bench --systems ideal,tokencake-roomy`` restarts each server for every round, so a round's
ratio carries the machine's drift between two one-minute replays minutes apart (±5-9 % on 2 shared
cores), which is larger than the ≤ 2 % it has to establish. Here every system's server is started
once and kept up; each trial is one fresh ci workload (its own seed, so no trial hits another's
prefix cache) replayed on every server back to back, in a seeded random order per trial. A trial's
ratio compares the same apps seconds apart; the interval is a t interval over trials.

Systems default to ``ideal`` (stock vLLM, enough KV never to evict), ``ideal-priority`` (the same with
``--scheduling-policy priority``, which every extension server runs) and ``tokencake-roomy`` (the
extension with the ideal's KV): ``tokencake-roomy / ideal`` is the whole cost of serving with the
extension, ``tokencake-roomy / ideal-priority`` the connector's part.

    PYTHONPATH=. .venv/bin/python benchmarks/extension_cost.py --trials 8 --out bench-out/extension-cost

A finer grain for tighter intervals: one agent of two calls per trial, replayed alone on each
server (``--apps 1 --turns 2 --tool-s 0.2 --gap-s 0.5 --trials 60``): each trial is seconds long,
so machine drift inside a trial is small, and many trials average the per-call noise.

Writes ``results.json`` (commit, dirty flag, per-trial measurements, ratios with 95 % intervals).
Only idle servers share the cores with the one replaying (an idle vLLM engine blocks on its queue).

Besides wall time it measures the CPU seconds the server's processes (API server, engine core,
worker) used during each replay. On a shared VM the wall time moves with other tenants' load
(steal), CPU time much less: for the same work, the extension's extra CPU time is its cost.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import psutil

from tokencake.bench import presets
from tokencake.bench.environment import loadavg, machine, versions
from tokencake.bench.intervals import mean_ci
from tokencake.bench.replay import replay
from tokencake.bench.systems import resolve_systems, server_kwargs

DEFAULT_SYSTEMS = ("ideal", "ideal-priority", "tokencake-roomy")
#: (numerator, denominator) of the ratios reported; only those whose systems ran.
RATIOS = (
    ("tokencake-roomy", "ideal"),
    ("tokencake-roomy", "ideal-priority"),
    ("ideal-priority", "ideal"),
)
#: Seconds between two replays: lets the last server's OpenMP threads stop spinning.
GAP_S = 2.0


def cpu_seconds(pid: int | None) -> dict[str, float]:
    """User + system CPU seconds of the server's live process tree, by process role."""
    out: dict[str, float] = {}
    if pid is None:
        return out
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for proc in procs:
        try:
            t = proc.cpu_times()
            name = proc.name()
        except psutil.Error:
            continue
        role = "worker" if "Work" in name else "engine" if "Engine" in name else "api"
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def trial_measure(data: dict[str, Any]) -> dict[str, Any]:
    """The per-replay numbers a trial compares (plus what shows the replay did no KV copies)."""
    ext = (data.get("extension") or {}).get("summary") or {}
    calls = [c for c in data["calls"] if c.get("status") == 200]
    return {
        "e2e_mean_s": data["client"]["e2e_s"]["mean"],
        "apps_failed": data["client"]["apps_failed"],
        "llm_s": sum(c["latency_s"] for c in calls),
        "calls": len(calls),
        "prompt_tokens": data["client"]["prompt_tokens"],
        "completion_tokens": data["client"]["completion_tokens"],
        "computed_prompt_tokens": data["server"].get("computed_prompt_tokens"),
        "queue_s_mean": ((data["server"].get("histograms") or {}).get("queue_s") or {}).get("mean"),
        "offloaded_blocks": ext.get("offloaded_blocks"),
        "connector_hook_s": ext.get("connector_hook_s"),
        "replay_s": data["replay_s"],
    }


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    out = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    out["total"] = sum(out.values())
    return out


def _metric(measured: dict[str, Any], metric: str) -> float:
    value = measured[metric]
    return float(value["total"] if isinstance(value, dict) else value)


def ratios(trials: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a, b in RATIOS:
        if a not in names or b not in names:
            continue
        for metric in ("e2e_mean_s", "llm_s", "cpu_s"):
            per = [
                _metric(t["systems"][a], metric) / _metric(t["systems"][b], metric)
                for t in trials
                if a in t["systems"] and b in t["systems"] and _metric(t["systems"][b], metric)
            ]
            out[f"{a}/{b}"] = out.get(f"{a}/{b}", {})
            out[f"{a}/{b}"][metric] = mean_ci(per)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    ap.add_argument("--seed", type=int, default=1000, help="first trial's workload seed")
    ap.add_argument("--out", default="bench-out/extension-cost")
    ap.add_argument("--apps", type=int, help="agents per trial (default: the ci preset's 6, concurrent)")
    ap.add_argument("--turns", type=int, help="LLM calls per agent (default: the ci preset's 3)")
    ap.add_argument("--tool-s", type=float, help="every tool call's duration (default: ci's 3.5-4.5 s)")
    ap.add_argument("--gap-s", type=float, default=GAP_S, help="idle seconds before each replay")
    args = ap.parse_args(argv)
    shape = {
        "apps": args.apps,
        "turns": args.turns,
        "tool_s": (args.tool_s, args.tool_s) if args.tool_s is not None else None,
    }
    specs = resolve_systems(args.systems.split(","))
    base = presets.build("ci", presets.Overrides(seed=args.seed, **shape))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from tokencake.serving import Server

    started, t0, ver, load0 = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.time(), versions(), loadavg()
    trials: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        servers = {}
        for spec in specs:  # one after another: booting three at once would only slow each
            kwargs = server_kwargs(spec, base.server, Server)
            kwargs["log_file"] = str(out / f"{spec.name}.log")
            servers[spec.name] = stack.enter_context(Server(**kwargs))
            print(f"{spec.name}: up", file=sys.stderr, flush=True)
        for i in range(args.trials):
            workload = presets.build("ci", presets.Overrides(seed=args.seed + i, **shape)).points[0].workload
            order = list(specs)
            random.Random(args.seed * 7919 + i).shuffle(order)
            per: dict[str, Any] = {}
            for spec in order:
                time.sleep(args.gap_s)
                server = servers[spec.name]
                cpu_before = cpu_seconds(getattr(server, "pid", None))
                data = anyio.run(
                    lambda w=workload, s=server, st=spec.stock, first=(i == 0): replay(
                        w,
                        base_url=s.base_url,
                        model=getattr(s, "model", None),
                        events_url=getattr(s, "events_url", None),
                        stock=st,
                        warmup=first,
                    )
                )
                per[spec.name] = trial_measure(data)
                per[spec.name]["cpu_s"] = cpu_delta(cpu_before, cpu_seconds(getattr(server, "pid", None)))
                m = per[spec.name]
                print(
                    f"trial {i + 1} {spec.name}: e2e {m['e2e_mean_s']:.2f} s, "
                    f"cpu {m['cpu_s']['total']:.1f} s",
                    file=sys.stderr,
                )
            trials.append(
                {"trial": i + 1, "seed": args.seed + i, "order": [s.name for s in order], "systems": per}
            )
    names = [s.name for s in specs]
    equal = all(
        len({t["systems"][n]["completion_tokens"] for n in names}) == 1
        and len({t["systems"][n]["prompt_tokens"] for n in names}) == 1
        for t in trials
    )
    results = {
        "kind": "tokencake-extension-cost",
        "started": started,
        "wall_s": round(time.time() - t0, 1),
        "versions": ver,
        "machine": {**machine(), "loadavg_start": load0, "loadavg_end": loadavg()},
        "config": {
            "preset": "ci",
            "systems": [s.to_dict() for s in specs],
            "trials": args.trials,
            "seed": args.seed,
            "shape": {k: v for k, v in shape.items() if v is not None},
            "description": base.description,
            "server": base.server.__dict__ | {"extra_args": list(base.server.extra_args)},
        },
        "equal_work": equal,
        "no_copies": all((t["systems"][n]["offloaded_blocks"] or 0) == 0 for t in trials for n in names),
        "valid": equal and not any(t["systems"][n]["apps_failed"] for t in trials for n in names),
        "trials": trials,
        "ratios": ratios(trials, names),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    for pair, by in results["ratios"].items():
        for metric, ci in by.items():
            lo, hi = ci["ci95"] or (None, None)
            print(f"{pair} {metric}: {ci['mean']:.4f} [{lo}, {hi}] n={ci['n']}")
    print(f"equal work: {equal}; no copies: {results['no_copies']}; wall {results['wall_s']} s")
    return 0 if results["valid"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
