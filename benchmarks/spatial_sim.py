"""The spatial scheduler's admission order against vLLM's priority order, in the simulator.

Issue 12's GPU-scale view and the evidence behind the score's weights (``docs/policy.md`` §7):
every mix below is simulated with the bench's ``spatial-off`` (TokenCake's KV policy under vLLM's
priority scheduler) and ``tokencake`` (the same policy with the spatial scheduler: its admission
order, critical-path chains evicted last and the critical reserve), twice per seed — once with the
shipped weights, once with the weighting before them (requests aged 5× faster, app age 10× as
heavy: first come first served by app; ``ablation``) — and the bench's spatial ablations
``spatial-order`` (the admission order only) and ``reserve-off`` (no reserve).
Mixes vary agent count, arrival rate, context length, shared prefixes, host pool size and the
hardware profile (CPU-measured and the H200 model); none is tuned for.

    python benchmarks/spatial_sim.py --out docs/bench/sim-spatial.json    # ~4 min on 2 cores
    python benchmarks/spatial_sim.py --variants --out docs/bench/sim-spatial-variants.json  # ~6 min

Writes per mix and seed: mean app E2E, mean queue wait of critical-path and other requests,
critical inversions (all, and unsaved: a block taken had no host copy), the non-critical requests
that waited for the critical reserve and the critical path's recomputed share of its resumed
prefixes for each system, and the ratios ``tokencake / spatial-off``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokencake.serving.spatial import ADMISSIONS, SpatialScorer, SpatialWeights
from tokencake.sim import engine as sim_engine
from tokencake.sim.presets import generate
from tokencake.sim.profiles import get_profile
from tokencake.sim.run import SYSTEMS, simulate

#: (label, profile, generate() keywords, host blocks or None for the profile's).
MIXES: tuple[tuple[str, str, dict[str, Any], int | None], ...] = (
    ("cpu stress 8 agents", "cpu-measured", {"preset": "stress", "agents": 8}, None),
    ("cpu stress 16 agents", "cpu-measured", {"preset": "stress", "agents": 16}, None),
    ("cpu stress 16 agents, host 48 blocks", "cpu-measured", {"preset": "stress", "agents": 16}, 48),
    (
        "cpu stress 24 agents at 0.5/s, shared prefix",
        "cpu-measured",
        {"preset": "stress", "agents": 24, "rate": 0.5, "shared_prefix_tokens": 1000},
        None,
    ),
    (
        "cpu stress 32 agents at 1/s, 600-token contexts",
        "cpu-measured",
        {"preset": "stress", "agents": 32, "rate": 1.0, "context_tokens": 600},
        None,
    ),
    ("cpu headroom 8 agents", "cpu-measured", {"preset": "headroom", "agents": 8}, None),
    (
        "h200 stress 64 agents, 16k contexts",
        "h200-llama3-8b",
        {"preset": "stress", "agents": 64, "turns": 10, "context_tokens": 16000, "rate": 2.0},
        None,
    ),
)

#: The weighting before: first come first served by app across classes (aging 0.25 s/s, app age
#: 1 s/s up to 300 s).
ABLATION = SpatialWeights(aging=0.25, app_age=1.0, max_app_age_s=300.0)


#: Other weightings, run with ``--variants``: what the shipped weights were chosen against.
VARIANTS: dict[str, SpatialWeights] = {
    "aging-0.25": SpatialWeights(aging=0.25, app_age=0.0),
    "aging-0.05-no-app": SpatialWeights(aging=0.05, app_age=0.0),
    "aging-0.05-app-0.05": SpatialWeights(aging=0.05, app_age=0.05),
    # The shipped weights until 2026-12-05 (apps that started seconds apart served side by side).
    "apps-side-by-side": ADMISSIONS["apps-side-by-side"],
    # The shipped weights with the SDK's slack fixed (a branch that fell behind stays non-critical).
    "static-slack": ADMISSIONS["static-slack"],
}


def _run(trace: Any, profile: Any, weights: SpatialWeights | None, host: int | None) -> Any:
    """``tokencake`` with ``weights`` (None: the shipped ones) on the engine's spatial queue."""
    if weights is None:
        return simulate(trace, profile, SYSTEMS["tokencake"], host_blocks=host)
    original = sim_engine.SpatialScorer
    sim_engine.SpatialScorer = lambda *_args: SpatialScorer(weights)  # type: ignore[assignment,misc]
    try:
        return simulate(trace, profile, replace(SYSTEMS["tokencake"], name="ablation"), host_blocks=host)
    finally:
        sim_engine.SpatialScorer = original  # type: ignore[misc]


#: The bench's spatial ablations, run on every mix.
ABLATIONS: tuple[str, ...] = ("spatial-order", "reserve-off", "spare-late", "reserve-arrival")


def _row(r: Any) -> dict[str, Any]:
    ext = r.extension or {}
    return {
        "e2e_mean_s": r.e2e_mean_s,
        "queue_wait_critical_mean_s": r.queue_wait_critical_mean_s,
        "queue_wait_noncritical_mean_s": r.queue_wait_noncritical_mean_s,
        "critical_inversions": ext.get("critical_inversions"),
        "critical_inversions_unsaved": ext.get("critical_inversions_unsaved"),
        # By a request that could not wait without delaying its own app (past its slack).
        "critical_inversions_late": ext.get("critical_inversions_late"),
        "critical_recomputed_share": ext.get("critical_recomputed_share"),
        # Non-critical requests that waited (within their slack) rather than evict a critical chain.
        "critical_reserve_waited_requests": (ext.get("counters") or {}).get(
            "spatial.critical_reserve_waited_requests", 0
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("sim-spatial.json"))
    ap.add_argument("--seeds", type=int, default=2, help="seeds per mix (default 2)")
    ap.add_argument("--variants", action="store_true", help="also run the weightings in VARIANTS")
    ap.add_argument(
        "--ablations", default=",".join(ABLATIONS), help=f"systems run beside (default {','.join(ABLATIONS)})"
    )
    args = ap.parse_args()
    ablations = tuple(a.strip() for a in args.ablations.split(",") if a.strip())
    unknown = [a for a in ablations if a not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    variants = VARIANTS if args.variants else {}
    started = time.perf_counter()
    rows = []
    for label, profile_name, kw, host in MIXES:
        profile = get_profile(profile_name)
        for seed in range(args.seeds):
            trace = generate(seed=seed, **kw)
            off = simulate(trace, profile, SYSTEMS["spatial-off"], host_blocks=host)
            on = _run(trace, profile, None, host)
            old = _run(trace, profile, ABLATION, host)
            row = {
                "mix": label,
                "seed": seed,
                "systems": {"spatial-off": _row(off), "tokencake": _row(on), "ablation": _row(old)},
                "tokencake/spatial-off": on.e2e_mean_s / off.e2e_mean_s,
                "ablation/spatial-off": old.e2e_mean_s / off.e2e_mean_s,
                "critical_wait_tokencake/spatial-off": _ratio(
                    on.queue_wait_critical_mean_s, off.queue_wait_critical_mean_s
                ),
            }
            for name in ablations:
                other = simulate(trace, profile, SYSTEMS[name], host_blocks=host)
                row["systems"][name] = _row(other)
                row[f"{name}/spatial-off"] = other.e2e_mean_s / off.e2e_mean_s
            for name, weights in variants.items():
                other = _run(trace, profile, weights, host)
                row["systems"][name] = _row(other)
                row[f"{name}/spatial-off"] = other.e2e_mean_s / off.e2e_mean_s
            rows.append(row)
            on_row, off_row = row["systems"]["tokencake"], row["systems"]["spatial-off"]
            print(
                f"{label} s{seed}: tokencake/spatial-off {row['tokencake/spatial-off']:.3f} "
                f"(ablation {row['ablation/spatial-off']:.3f}), critical wait "
                f"{on.queue_wait_critical_mean_s:.1f} vs {off.queue_wait_critical_mean_s:.1f} s, "
                f"inversions {on_row['critical_inversions']} "
                f"({on_row['critical_inversions_unsaved']} unsaved, "
                f"{on_row['critical_inversions_late']} late) "
                f"vs {off_row['critical_inversions']} ({off_row['critical_inversions_unsaved']} unsaved, "
                f"{off_row['critical_inversions_late']} late)",
                flush=True,
            )
    ratios = [r["tokencake/spatial-off"] for r in rows]
    old = [r["ablation/spatial-off"] for r in rows]
    key = "critical_wait_tokencake/spatial-off"
    waits = [r[key] for r in rows if r[key]]
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, check=False
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain", "tokencake"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent.parent,
            check=False,
        ).stdout.strip()
    )
    doc = {
        "versions": {"git_commit": commit, "git_dirty": dirty},
        "weights": SpatialWeights().__dict__,
        "ablation_weights": ABLATION.__dict__,
        "rows": rows,
        "summary": {
            "n": len(rows),
            "tokencake/spatial-off": _spread(ratios),
            "ablation/spatial-off": _spread(old),
            "critical_wait_tokencake/spatial-off": _spread(waits),
            "tokencake_not_worse_than_1.05": sum(r <= 1.05 for r in ratios),
            **{
                f"{name}/spatial-off": _spread([r[f"{name}/spatial-off"] for r in rows]) for name in ablations
            },
            # Summed over every mix and seed, per system.
            **{
                f"{key}_total": {
                    name: sum(r["systems"][name][key] or 0 for r in rows)
                    for name in ("tokencake", "spatial-off", *ablations)
                }
                for key in (
                    "critical_inversions",
                    "critical_inversions_unsaved",
                    "critical_inversions_late",
                    "critical_reserve_waited_requests",
                )
            },
            # Mixes and seeds where tokencake had fewer / more unsaved inversions than spatial-off.
            "unsaved_inversions_fewer_more": [
                sum(_unsaved(r, "tokencake") < _unsaved(r, "spatial-off") for r in rows),
                sum(_unsaved(r, "tokencake") > _unsaved(r, "spatial-off") for r in rows),
            ],
            **{f"{name}/spatial-off": _spread([r[f"{name}/spatial-off"] for r in rows]) for name in variants},
        },
        "variant_weights": {name: w.__dict__ for name, w in variants.items()},
        "wall_s": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc["summary"], indent=2))
    return 0


def _unsaved(row: dict[str, Any], system: str) -> int:
    return row["systems"][system]["critical_inversions_unsaved"] or 0


def _ratio(a: float, b: float) -> float | None:
    return a / b if b and b == b and a == a else None


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "min": min(values),
        "max": max(values),
        "geomean": statistics.geometric_mean(values),
    }


if __name__ == "__main__":
    raise SystemExit(main())
