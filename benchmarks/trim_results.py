"""Trim a stored ``tokencake bench`` results file to what its comparisons and quoted numbers read.

A ``results.json`` holds every call, the KV usage samples and the extension's raw ``/v1/stats``
snapshots: 0.3–2 MB a run. A run kept in ``docs/bench`` to back numbers the docs quote needs far
less. :func:`trim` drops, per system, ``calls`` (per-call records), ``kv`` (KV usage samples), the
extension's ``delta`` and ``after`` snapshots (its ``summary`` stays) and each app's per-node
timings (``nodes``), and records under ``trimmed`` what it dropped and the commit whose tree holds the
full file. Everything :func:`tokencake.bench.rounds.reaggregate` reads stays — apps' E2E and status,
the client and server summaries, the extension's summary — so a trimmed file's comparisons and
aggregate recompute exactly, and the workload, config, versions, machine and round orders are kept.
A trimmed file cannot rebuild a simulator trace (no calls; ``tokencake/sim/fixtures`` holds those
compact copies) or re-render plots (``tokencake bench --report``); ``git show COMMIT:PATH`` gives the
full file back.

    python benchmarks/trim_results.py docs/bench/NAME-results.json ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

#: Per-system keys dropped, the extension's raw snapshots dropped, and the per-app key dropped.
SYSTEM_KEYS = ("calls", "kv")
EXTENSION_KEYS = ("delta", "after")
APP_KEYS = ("nodes",)


def trim(results: dict[str, Any], full_at: str | None) -> dict[str, Any]:
    """``results`` without the raw records (see the module docstring), in place; ``full_at``: the
    commit whose tree holds the full file. A file trimmed before is returned as it is."""
    if results.get("trimmed"):
        return results
    for point in results.get("points") or []:
        for system in point["systems"].values():
            for key in SYSTEM_KEYS:
                system.pop(key, None)
            ext = system.get("extension")
            if isinstance(ext, dict):
                for key in EXTENSION_KEYS:
                    ext.pop(key, None)
            for app in system.get("apps") or []:
                for key in APP_KEYS:
                    app.pop(key, None)
    dropped = [*SYSTEM_KEYS, *(f"extension.{k}" for k in EXTENSION_KEYS), *(f"apps.{k}" for k in APP_KEYS)]
    results["trimmed"] = {"dropped": dropped, "full_at": full_at}
    return results


def committed_at(path: Path) -> str | None:
    """The last commit that changed ``path`` when the file on disk is that commit's (else None)."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=path.parent, capture_output=True, text=True, check=False)

    if git("diff", "--quiet", "HEAD", "--", path.name).returncode != 0:
        return None
    out = git("log", "-1", "--format=%H", "--", path.name).stdout.strip()
    return out or None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    for path in args.files:
        before = path.stat().st_size
        results = trim(json.loads(path.read_text()), committed_at(path))
        path.write_text(json.dumps(results, indent=1, default=str) + "\n")
        full_at = results["trimmed"]["full_at"]
        print(f"{path}: {before:,} -> {path.stat().st_size:,} bytes (full file at {full_at})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
