"""Issue 12, one lever in the simulator: where critical-path chains safe on host sit in the eviction order.

TokenCake demotes an offloaded stall's device chain to the front of vLLM's free queue (evicted
first), non-critical sessions ahead of critical-path ones. This replays ``tokencake`` twice per mix
— as shipped (``base``), and with critical-path chains *not* demoted, left at their LRU place
(``critlru``) — on the mixes of ``benchmarks/spatial_sim.py`` (two seeds each) and, with
``--big``, a 1,024-agent stress mix on the H200 model (8,000-token contexts). It reports mean app E2E,
critical-path queue wait and critical inversions (all, late, unsaved) per variant.

    python benchmarks/eviction_order_sim.py --out sim-eviction-order.json          # ~5 min
    python benchmarks/eviction_order_sim.py --big --out sim-eviction-order-1024.json  # ~25 min
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from spatial_sim import MIXES, _row  # type: ignore[import-not-found]

from tokencake.serving.kvcore.core import KVCore
from tokencake.sim.presets import generate
from tokencake.sim.profiles import get_profile
from tokencake.sim.run import SYSTEMS, simulate

BIG = (
    "h200 stress 1024 agents",
    "h200-llama3-8b",
    {"preset": "stress", "agents": 1024, "turns": 10, "context_tokens": 8000, "rate": 2.0},
    None,
)


class CriticalLruCore(KVCore):
    """The ``critlru`` variant of the KV core: a critical-path chain keeps its LRU place."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        demote = self.eviction.demote

        def lru_for_critical(stall: Any) -> None:
            if not (stall.critical and self.critical_last):
                demote(stall)

        self.eviction.demote = lru_for_critical  # type: ignore[method-assign]


def run(trace: Any, profile: Any, host: int | None, variant: str) -> Any:
    factory = CriticalLruCore if variant == "critlru" else KVCore
    return simulate(trace, profile, SYSTEMS["tokencake"], host_blocks=host, core_factory=factory)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("sim-eviction-order.json"))
    ap.add_argument("--big", action="store_true", help="the 1,024-agent mix only")
    args = ap.parse_args()
    cases = [(*BIG, 0)] if args.big else [(*m, seed) for m in MIXES for seed in (0, 1)]
    rows = []
    for label, prof, kw, host, seed in cases:
        profile, trace = get_profile(prof), generate(seed=seed, **kw)
        row: dict[str, Any] = {"label": label, "seed": seed}
        for variant in ("base", "critlru"):
            started = time.perf_counter()
            row[variant] = {
                **_row(run(trace, profile, host, variant)),
                "wall_s": round(time.perf_counter() - started, 1),
            }
        row["e2e_ratio"] = row["critlru"]["e2e_mean_s"] / row["base"]["e2e_mean_s"]
        print(
            f"{label} seed {seed}: E2E critlru/base {row['e2e_ratio']:.3f}, inversions "
            f"{row['base']['critical_inversions']} -> {row['critlru']['critical_inversions']}",
            flush=True,
        )
        rows.append(row)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    args.out.write_text(
        json.dumps({"kind": "tokencake-sim-eviction-order", "git_commit": commit, "rows": rows}, indent=1)
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
