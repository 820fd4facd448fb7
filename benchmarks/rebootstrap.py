"""Stored runs' paired intervals, recomputed with the bootstrap that resamples by app.

Runs stored before the paired bootstrap resampled apps (then each app's rounds) carry intervals
from resampling (app, round) pairs as if each were an independent sample; an app replays the same
workload every round, so that understates the spread. This recomputes each stored run's paired
ratios from its own per-app E2E (``points``) with the current
:func:`tokencake.bench.rounds.paired_intervals` and writes them beside the stored ones; the
stored files are left as measured.

    python benchmarks/rebootstrap.py docs/bench/NAME-results.json ... --out paired-by-app.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tokencake.bench.rounds import paired_intervals


def rebootstrap(results: dict[str, Any]) -> dict[str, Any]:
    """``{point: {pair: {"stored": ..., "by_app": ...}}}`` for every paired headline of a run."""
    out: dict[str, Any] = {}
    points = results.get("points") or []
    for base, agg in (results.get("aggregate") or {}).items():
        rounds = [p for p in points if p.get("base_label", p["label"]) == base]
        fresh = paired_intervals(rounds)
        out[base] = {
            pair: {"stored": stored, "by_app": fresh.get(pair)}
            for pair, stored in (agg.get("paired") or {}).items()
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    doc = {
        path.name: {
            "git_commit": (json.loads(path.read_text()).get("versions") or {}).get("git_commit"),
            "points": rebootstrap(json.loads(path.read_text())),
        }
        for path in args.results
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for name, entry in doc.items():
        for point, pairs in entry["points"].items():
            for pair, both in pairs.items():
                old, new = both["stored"], both["by_app"] or {}
                print(f"{name} {point} {pair}: {old.get('ratio'):.3f} {old.get('ci95')} -> {new.get('ci95')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
