"""How the H200 model's GPU results move with the assumptions that move them.

Every GPU figure of the simulator is a model prediction. Its step constants are fitted to step
times measured on an H200 and its copy constants to copies measured there
(``tokencake.sim.calibrate``), but three assumptions carry most of the result, so each is varied:

* **decode share** — the share of peak HBM bandwidth at which decode reads KV: the fit (~0.52),
  0.8 (the datasheet-style assumption the profile used before it was fitted) and 0.5;
* **copy overlap** — ``measured``: a copy that starts while the other direction's is running gets
  the measured duplex share of its rate, and a step beside a side-stream copy is slowed by the
  measured 2.4 %; ``perfect``: neither;
* **PCIe rate** — the measured ~55 GB/s each way, or half of it.

Workload: ``docs/simulation.md``'s stress preset on ``h200-llama3-8b`` (``--agents`` workers, 10
turns, 16,000-token contexts, 2 apps/s, seed 0). Per cell: ``tokencake`` (``return_reserve=auto``:
room kept ahead of returns, on where copies run on side streams), ``return-reserve-off`` and the
never-evicting ``ideal`` (no copies: it depends on the decode share alone, so it is run once per
share). ``on/off`` < 1 means kept room pays.

    python benchmarks/gpu_sensitivity.py --agents 64 --out docs/bench/sim-gpu-sensitivity.json
    python benchmarks/gpu_sensitivity.py --agents 256 --grid axes --out docs/bench/sim-gpu-sensitivity.json

``--grid axes`` runs the calibrated cell and each assumption varied alone (5 cells); ``full`` all 12.
Rows already in ``--out`` are kept and not rerun (the run can be resumed, or extended by a point);
they are stored by agents, then in the full grid's order.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

from tokencake.bench.environment import versions
from tokencake.sim.presets import generate
from tokencake.sim.profiles import HardwareProfile, get_profile
from tokencake.sim.run import SimResult, simulate

PROFILE = "h200-llama3-8b"
WORKLOAD = {"preset": "stress", "turns": 10, "context_tokens": 16_000, "rate": 2.0, "seed": 0}
#: Decode shares: None = the profile's (the fit).
DECODE_SHARES: tuple[float | None, ...] = (None, 0.8, 0.5)
OVERLAPS = ("measured", "perfect")
PCIE_SCALES = (1.0, 0.5)
SYSTEMS = ("tokencake", "return-reserve-off")


def cell_profile(
    base: HardwareProfile, decode_share: float | None, overlap: str, pcie: float
) -> HardwareProfile:
    """``base`` with one cell's assumptions (renamed to say which)."""
    changes: dict[str, Any] = {}
    if decode_share is not None:
        changes["decode_s_per_ctx_token"] = base.kv_bytes_per_token / (decode_share * base.hbm_bytes_per_s)
    if overlap == "perfect":
        changes.update(duplex_share=1.0, copy_compute_slowdown=0.0)
    if pcie != 1.0:
        changes.update(
            d2h_bytes_per_s=base.d2h_bytes_per_s * pcie, h2d_bytes_per_s=base.h2d_bytes_per_s * pcie
        )
    name = f"{base.name}[decode={decode_share or 'fit'},overlap={overlap},pcie=x{pcie:g}]"
    return base.with_(name=name, **changes)


def cells(grid: str) -> list[tuple[float | None, str, float]]:
    """The calibrated cell first, then each assumption varied alone, then (``full``) the rest."""
    calibrated = (DECODE_SHARES[0], OVERLAPS[0], PCIE_SCALES[0])
    axes = [calibrated]
    axes += [(d, OVERLAPS[0], PCIE_SCALES[0]) for d in DECODE_SHARES[1:]]
    axes += [(DECODE_SHARES[0], o, PCIE_SCALES[0]) for o in OVERLAPS[1:]]
    axes += [(DECODE_SHARES[0], OVERLAPS[0], p) for p in PCIE_SCALES[1:]]
    if grid == "axes":
        return axes
    rest = [c for c in itertools.product(DECODE_SHARES, OVERLAPS, PCIE_SCALES) if c not in axes]
    return axes + rest


def summary(r: SimResult) -> dict[str, Any]:
    ext = r.extension or {}
    return {
        "e2e_mean_s": r.e2e_mean_s,
        "ready_rate": ext.get("ready_rate"),
        "device_hit_rate": r.device_hit_tokens / r.prompt_tokens if r.prompt_tokens else None,
        "host_hit_tokens": r.host_hit_tokens,
        "computed_prompt_tokens": r.computed_prompt_tokens,
        "wall_s": round(r.wall_s, 1),
    }


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    c = row["cell"]
    return (row["agents"], c["decode_share"], c["overlap"], c["pcie"])


def _order(row: dict[str, Any]) -> tuple[int, int]:
    """Rows stored by agents, then in ``cells("full")`` order, whichever order they were run in."""
    c = row["cell"]
    return row["agents"], cells("full").index((c["decode_share"], c["overlap"], c["pcie"]))


#: The ratios each row holds; the stored file gives each one's range over the cells per agents.
RATIOS = ("tokencake/ideal", "return-reserve-off/ideal", "on/off")


def _write(out: Path, rows: list[dict[str, Any]], ideals: dict[str, Any]) -> None:
    """The stored file: the rows sorted (``_order``) and, per number of agents, each ratio's range
    over the cells run (``ranges``)."""
    rows.sort(key=_order)
    ranges: dict[str, dict[str, Any]] = {}
    for agents in sorted({r["agents"] for r in rows}):
        mine = [r for r in rows if r["agents"] == agents]
        ranges[str(agents)] = {
            k: {"min": min(r[k] for r in mine), "max": max(r[k] for r in mine), "cells": len(mine)}
            for k in RATIOS
        }
    doc = {
        "kind": "sim-gpu-sensitivity",
        "versions": versions(),
        "profile": PROFILE,
        "workload": WORKLOAD,
        "systems": [*SYSTEMS, "ideal"],
        "ideal": ideals,
        "rows": rows,
        "ranges": ranges,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--grid", choices=("axes", "full"), default="full")
    ap.add_argument("--out", type=Path, default=Path("sim-gpu-sensitivity.json"))
    args = ap.parse_args()
    base = get_profile(PROFILE)
    doc: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    rows: list[dict[str, Any]] = doc.get("rows", [])
    ideals: dict[str, Any] = doc.get("ideal", {})
    done = {_key(r) for r in rows}
    w = WORKLOAD
    trace = generate(
        "stress",
        agents=args.agents,
        turns=w["turns"],
        context_tokens=w["context_tokens"],
        rate=w["rate"],
        seed=w["seed"],
    )
    for decode_share, overlap, pcie in cells(args.grid):
        cell = {"decode_share": decode_share, "overlap": overlap, "pcie": pcie}
        if (args.agents, decode_share, overlap, pcie) in done:
            continue
        prof = cell_profile(base, decode_share, overlap, pcie)
        ideal_key = f"{args.agents}/{decode_share or 'fit'}"
        if ideal_key not in ideals:
            ideals[ideal_key] = summary(simulate(trace, prof, "ideal"))
        row: dict[str, Any] = {
            "agents": args.agents,
            "cell": cell,
            "profile": prof.name,
            "decode_share": prof.decode_share,
        }
        env = versions()
        row["git_commit"], row["git_dirty"] = env.get("git_commit"), env.get("git_dirty")
        started = time.perf_counter()
        for system in SYSTEMS:
            row[system] = summary(simulate(trace, prof, system))
        ideal = ideals[ideal_key]["e2e_mean_s"]
        row["tokencake/ideal"] = row["tokencake"]["e2e_mean_s"] / ideal
        row["return-reserve-off/ideal"] = row["return-reserve-off"]["e2e_mean_s"] / ideal
        row["on/off"] = row["tokencake"]["e2e_mean_s"] / row["return-reserve-off"]["e2e_mean_s"]
        rows.append(row)
        _write(args.out, rows, ideals)
        print(
            f"{args.agents} agents {cell}: tokencake/ideal {row['tokencake/ideal']:.3f}, "
            f"off/ideal {row['return-reserve-off/ideal']:.3f}, on/off {row['on/off']:.3f} "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    _write(args.out, rows, ideals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
