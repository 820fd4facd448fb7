"""How close to the ideal the device's size lets any transfer policy come (issue 9's stress gap).

The CPU stress runs up to ``stress-lag`` recomputed nothing and loaded a round's host KV in ~0.1 s,
yet stayed 1.10-1.15 x the never-evicting ideal. The question this answers: is the rest the KV
policy's (its copies, their timing) or the device's (how many sessions fit at once)? Each stored
real run of the faster host (``tokencake.sim.stored.FIXTURES``, profile ``cpu-fast``; the runs
that saved into first-touch host pages at their own copy rates) is replayed on the simulator with
the run's own device and host blocks, and with **every copy free** (infinite
bandwidth, no per-job cost): then a session's KV is back on device the moment room exists, so what
is left of the gap is admission at this many blocks. Per run it reports

* ``ratios``: ``system/ideal`` predicted as served and with free copies, per admission order
  (TokenCake's spatial order, its fixed-slack order, vLLM's priority order = ``spatial-off``, and
  ``offload-all`` = everything saved and reloaded);
* ``copies_cost``: how much slower TokenCake is as served than with free copies (paired on one fit);
  ``best_order+free/tokencake+free``: the best of the orders with free copies against TokenCake's;
* ``blocks_for_target``: the fewest device blocks (in steps of 4) at which TokenCake with free
  copies is within ``TARGET`` of the ideal;
* all of it for every ``cpu-fast`` fit within ``FIT_SLACK`` of the best fit's error (the fit does
  not pin the constants down; ratios are given as the range over them).

    python benchmarks/capacity_bound.py --out docs/bench/sim-capacity-bound.json     # ~1 min
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tokencake.bench.environment import versions
from tokencake.sim.presets import from_bench_point
from tokencake.sim.profiles import HardwareProfile, get_profile
from tokencake.sim.run import SYSTEMS, simulate
from tokencake.sim.stored import FIXTURES, calls_from, read_results
from tokencake.sim.trace import Trace
from tokencake.sim.validate import grid_errors, served_profile

PROFILE = "cpu-fast"
TARGET = 1.10
#: Fits whose worst error on the fitted runs is within this of the best one's all count.
FIT_SLACK = 0.01
ORDERS: tuple[str, ...] = ("tokencake", "static-slack", "spatial-off", "offload-all")


def near_fits(profile: str = PROFILE, slack: float = FIT_SLACK) -> list[dict[str, float]]:
    """Every grid point of ``profile``'s fit whose worst error is within ``slack`` of the best."""
    scored = grid_errors(profile)
    return [params for err, params in scored if err <= scored[0][0] + slack]


def free_copies(profile: HardwareProfile) -> HardwareProfile:
    return profile.with_(
        name=f"{profile.name}+free-copies", d2h_bytes_per_s=1e18, h2d_bytes_per_s=1e18, copy_base_s=0.0
    )


def bound(server: dict[str, Any], trace: Trace, prof: HardwareProfile) -> dict[str, Any]:
    """One stored run (its server config and trace) on one profile: ratios as served and with free
    copies; blocks for the target."""
    hosts = server.get("host_pool_blocks") or prof.host_blocks
    device = int(server["device_blocks"])
    ideal = simulate(
        trace, prof, SYSTEMS["ideal"], device_blocks=server["ideal_blocks"], host_blocks=hosts
    ).e2e_mean_s
    free = free_copies(prof)
    ratios: dict[str, float] = {}
    for system in ORDERS:
        ratios[f"{system}/ideal"] = (
            simulate(trace, prof, SYSTEMS[system], device_blocks=device, host_blocks=hosts).e2e_mean_s / ideal
        )
        ratios[f"{system}+free/ideal"] = (
            simulate(trace, free, SYSTEMS[system], device_blocks=device, host_blocks=hosts).e2e_mean_s / ideal
        )
    # Paired on one fit: what free copies would buy TokenCake, and what the best other order would.
    ratios["copies_cost"] = ratios["tokencake/ideal"] / ratios["tokencake+free/ideal"] - 1
    ratios["best_order+free/tokencake+free"] = (
        min(ratios[f"{o}+free/ideal"] for o in ORDERS) / ratios["tokencake+free/ideal"]
    )
    needed = None
    for blocks in range(device, int(server["ideal_blocks"]) + 4, 4):
        r = (
            simulate(trace, free, SYSTEMS["tokencake"], device_blocks=blocks, host_blocks=hosts).e2e_mean_s
            / ideal
        )
        if r <= TARGET:
            needed = blocks
            break
    return {
        "device_blocks": device,
        "ideal_blocks": server["ideal_blocks"],
        "ratios": ratios,
        "blocks_for_target": needed,
    }


def _measured(results: dict[str, Any]) -> dict[str, Any]:
    agg = next(iter(results.get("aggregate", {}).values()), {})
    return {k: v.get("ratio") for k, v in agg.get("paired", {}).items() if k.endswith("/ideal")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("sim-capacity-bound.json"))
    args = ap.parse_args()
    fits = near_fits()
    runs = [n for n, f in FIXTURES.items() if f.profile == PROFILE]
    per_run: dict[str, Any] = {}
    for name in runs:
        results = read_results(FIXTURES[name].path)
        point = results["points"][0]
        trace = from_bench_point(point, calls_from(point))
        server = results["config"]["server"]
        base = get_profile(PROFILE)
        rows = [
            bound(server, trace, served_profile(FIXTURES[name], results, base.with_(**params)))
            for params in fits
        ]
        keys = rows[0]["ratios"].keys()
        needed = [r["blocks_for_target"] for r in rows]
        per_run[name] = {
            "run": FIXTURES[name].results_name,
            "fitted": FIXTURES[name].fitted,
            "device_blocks": rows[0]["device_blocks"],
            "ideal_blocks": rows[0]["ideal_blocks"],
            "measured": _measured(results),
            "ratios": {
                k: {"min": min(r["ratios"][k] for r in rows), "max": max(r["ratios"][k] for r in rows)}
                for k in keys
            },
            "blocks_for_target": {
                "min": min((b for b in needed if b is not None), default=None),
                "max": None if None in needed else max(needed),
            },
        }
        lo, hi = per_run[name]["ratios"]["tokencake+free/ideal"].values()
        need = per_run[name]["blocks_for_target"]
        print(f"{name}: tokencake/ideal with free copies {lo:.3f}-{hi:.3f}; blocks for <= {TARGET}: {need}")
    doc = {
        "kind": "tokencake-capacity-bound",
        "profile": PROFILE,
        "target": TARGET,
        "fit_slack": FIT_SLACK,
        "n_fits": len(fits),
        "fits": fits,
        "runs": per_run,
        "summary": {
            "copies_cost_max": max(r["ratios"]["copies_cost"]["max"] for r in per_run.values()),
            "best_order_gain_max": 1
            - min(r["ratios"]["best_order+free/tokencake+free"]["min"] for r in per_run.values()),
        },
        "versions": versions(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out} ({len(fits)} fits)")


if __name__ == "__main__":
    main()
