"""Room kept ahead of returns (``Options.return_reserve``), sized in the simulator on both hosts.

Issue 9 asks that a returning session's KV be on device when its next request arrives. The prefetch
budget never takes blocks the queue needs, so on a device that holds a few sessions most chains come
back only after their request (``readiness.no_room``). Kept room (``docs/policy.md`` §4) treats a
due return as a request at the head of the queue until the late end of its likely return. It is on
by default only where copies run on side streams beside the forward (``auto``). This measures both
sides of that choice, with nothing tuned here:

* **CPU** (where ``auto`` keeps it off): every stored real run at the current serving code that
  the simulator replays (``tokencake.sim.stored.FIXTURES`` ``*@pop``), on the profile of the host
  it ran on, as served — TokenCake (kept room off) against ``return-reserve`` (forced on).
* **GPU** (where ``auto`` turns it on): the H200 model's stress workload of ``docs/simulation.md``
  §6 at 64 agents (about the device KV) over three draws and at 256 agents (4–5 × it) over one —
  TokenCake (kept room on) against ``return-reserve-off`` and the never-evicting ideal.

    python benchmarks/return_reserve_sim.py --out docs/bench/sim-return-reserve.json   # ~10 min

Per row: mean app E2E of each system, the ratio with kept room on / off, and each side's readiness
(ready at arrival, the share of eligible arrivals that found no room, admissions that waited).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokencake.bench.environment import versions
from tokencake.sim.presets import from_bench_point, generate
from tokencake.sim.profiles import get_profile
from tokencake.sim.run import SYSTEMS, SimResult, simulate
from tokencake.sim.stored import FIXTURES, read_results
from tokencake.sim.validate import SERVED_WITH, served_profile

#: The stored real runs at the current serving code (the ``*@pop`` fixtures).
CPU_FIXTURES: tuple[str, ...] = tuple(name for name in FIXTURES if name.endswith("@pop"))
#: ``docs/simulation.md`` §6's workload on the H200 model: (agents, seeds).
GPU_POINTS: tuple[tuple[int, tuple[int, ...]], ...] = ((64, (0, 1, 2)), (256, (0,)))
GPU_PROFILE = "h200-llama3-8b"


def readiness(r: SimResult) -> dict[str, Any]:
    """One side's E2E and readiness (the extension's own ``ready_rate``; ``no_room_share`` as
    ``benchmarks/unseen_sim.py`` pools it), admissions held back and where prompts came from."""
    ext = r.extension or {}
    c = ext.get("counters", {})
    eligible = c.get("readiness.eligible", 0)
    return {
        "e2e_mean_s": r.e2e_mean_s,
        "ready_rate": ext.get("ready_rate"),
        "no_room_share": c.get("readiness.no_room", 0) / eligible if eligible else None,
        "eligible": eligible,
        "denials": c.get("return_reserve.denials", 0),
        "device_hit_rate": r.device_hit_tokens / r.prompt_tokens if r.prompt_tokens else None,
        "host_hit_tokens": r.host_hit_tokens,
    }


def cpu_rows() -> list[dict[str, Any]]:
    """TokenCake as served (kept room off on a CPU) against it forced on, per stored run."""
    rows = []
    for name in CPU_FIXTURES:
        fixture = FIXTURES[name]
        results = read_results(fixture.path)
        prof = served_profile(fixture, results, get_profile(fixture.profile))
        server = results["config"]["server"]
        hosts = server.get("host_pool_blocks") or prof.host_blocks
        point = results["points"][0]
        trace = from_bench_point(point, "baseline" if "baseline" in point["systems"] else "tokencake")
        out: dict[str, Any] = {
            "fixture": name,
            "point": point.get("base_label", point["label"]).split("#")[0],
        }
        for side, system in (("off", "tokencake"), ("on", "return-reserve")):
            spec = replace(SYSTEMS[system], options={**SYSTEMS[system].options, **SERVED_WITH})
            sim = simulate(trace, prof, spec, device_blocks=server["device_blocks"], host_blocks=hosts)
            out[side] = readiness(sim)
        out["on/off"] = out["on"]["e2e_mean_s"] / out["off"]["e2e_mean_s"]
        rows.append(out)
        print(f"cpu {name}: on/off {out['on/off']:.3f}", flush=True)
    return rows


def gpu_rows() -> list[dict[str, Any]]:
    """TokenCake as served on a GPU (kept room on) against it off, and the ideal, per draw."""
    prof = get_profile(GPU_PROFILE)
    rows = []
    for agents, seeds in GPU_POINTS:
        for seed in seeds:
            trace = generate("stress", agents=agents, turns=10, context_tokens=16_000, rate=2.0, seed=seed)
            out: dict[str, Any] = {"agents": agents, "seed": seed}
            for side, system in (("on", "tokencake"), ("off", "return-reserve-off")):
                out[side] = readiness(simulate(trace, prof, system))
            ideal = simulate(trace, prof, "ideal").e2e_mean_s
            out["ideal_e2e_mean_s"] = ideal
            out["on/off"] = out["on"]["e2e_mean_s"] / out["off"]["e2e_mean_s"]
            out["on/ideal"] = out["on"]["e2e_mean_s"] / ideal
            out["off/ideal"] = out["off"]["e2e_mean_s"] / ideal
            rows.append(out)
            print(f"gpu {agents} agents seed {seed}: on/off {out['on/off']:.3f}", flush=True)
    return rows


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "geomean": math.exp(statistics.fmean(math.log(v) for v in values)),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _mean(rows: list[dict[str, Any]], side: str, key: str) -> float | None:
    values = [r[side][key] for r in rows if r[side][key] is not None]
    return statistics.fmean(values) if values else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "on/off": _spread([r["on/off"] for r in rows]),
        **{
            f"{side}:{key}": _mean(rows, side, key)
            for side in ("on", "off")
            for key in ("ready_rate", "no_room_share")
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("sim-return-reserve.json"))
    args = ap.parse_args()
    cpu, gpu = cpu_rows(), gpu_rows()
    doc = {
        "kind": "sim-return-reserve",
        "versions": versions(),
        "cpu": {"profile": "each fixture's host (cpu-fast)", "rows": cpu, "summary": summarize(cpu)},
        "gpu": {
            "profile": GPU_PROFILE,
            "workload": "stress, 10 turns, 16,000-token contexts, 2 apps/s",
            "rows": gpu,
            "summary": {
                str(agents): summarize([r for r in gpu if r["agents"] == agents]) for agents, _ in GPU_POINTS
            },
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({"cpu": doc["cpu"]["summary"], "gpu": doc["gpu"]["summary"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
