"""Recompute a stored ``results.json``'s comparisons and aggregate with the current code's pairs.

``tokencake bench`` computes the ratio of every pair in ``tokencake.bench.compare.HEADLINE_PAIRS``
that a run has both systems of. A pair added after a run was made (a new ablation's system against
``tokencake``) is absent from its stored file; this recomputes the comparisons and the aggregate
(the per-round intervals and the paired bootstrap, whose seeds are fixed) from the run's own
points, leaving every measurement as it is, and records the commit that did it
(``reaggregated_at``).

    python benchmarks/reaggregate.py docs/bench/NAME-results.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokencake.bench.environment import versions
from tokencake.bench.rounds import reaggregate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    for path in args.files:
        results = reaggregate(json.loads(path.read_text()))
        results["reaggregated_at"] = versions().get("git_commit")
        path.write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"{path}: comparisons and aggregate recomputed over {len(results['points'])} points")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
