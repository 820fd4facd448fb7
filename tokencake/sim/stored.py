"""The stored real runs the simulator is checked against, shipped as compact package data.

A ``tokencake bench`` ``results.json`` holds far more than the check reads (every call's text hash,
timings, server metrics, KV samples: about 1 MB a run). :func:`compact` keeps what
``tokencake.sim.validate`` reads — per point its label and workload (the seeded apps' arrivals and
parameters), per system the apps' arrival and E2E seconds and, for the system the trace takes its
tokens from, every call's node, start and token counts; the server's device / ideal / host block
counts; which systems ran the spatial scheduler; TokenCake's copy bytes and seconds; the paired
``…/ideal`` ratios — in the same layout, so a compact file is read exactly as the full one.
The compact copies live in ``tokencake/sim/fixtures/<results name>.gz`` and are read with
``importlib.resources``, so an installed package validates without a clone. They stand in for the
full files, which the repository keeps only in its history (``git log -- docs/bench/NAME``) or
trimmed (``benchmarks/trim_results.py``: no calls); :func:`fixtures_in` reads full files from a
directory instead. ``python -m tokencake.sim.stored DIR`` rewrites the compact copies from the full
files in ``DIR``.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

__all__ = [
    "FIXTURES",
    "REPLAYED",
    "Fixture",
    "StoredRunsMissing",
    "calls_from",
    "compact",
    "fixtures_in",
    "read_results",
    "write_compact",
]

#: The package directory that holds the compact copies.
PACKAGED: Traversable = resources.files("tokencake.sim") / "fixtures"


class StoredRunsMissing(FileNotFoundError):
    """A stored run is not where it is read from; the message is one line that says where to look."""


@dataclass(frozen=True)
class Fixture:
    """A stored real run, the profile of the host it ran on, and whether that profile was fitted on it.

    ``path``: the run's results file (full, or the compact ``.gz`` copy). ``fitted``: the profile's
    constants were chosen on this run (``validate.fit``), so its error is not a test of the model;
    the others are held out. ``copies_as_measured``: replay the run with the copy rates it measured
    (its extension's bytes ÷ seconds) instead of the profile's — for runs whose copies were slower
    than the host's for a reason since fixed (offloads into host pages first touched at the copy,
    before the pool was populated at start, ``docs/reliability.md``), so they still check the
    model of everything else.
    """

    path: Traversable
    profile: str = "cpu-measured"
    fitted: bool = False
    copies_as_measured: bool = False

    @property
    def results_name(self) -> str:
        """The full results file's name (``ci-results.json``), also for a compact copy."""
        return self.path.name.removesuffix(".gz")


def _packaged(results_name: str, profile: str = "cpu-measured", **flags: bool) -> Fixture:
    return Fixture(PACKAGED / f"{results_name}.gz", profile, **flags)


#: The stored real runs the check uses (name → run): the first hosts (``cpu-measured``), the faster
#: hosts with copies into first-touch pages (``…@fast``, replayed at their own copy rates), and the
#: faster hosts with the host pool populated at start (``…@pop``).
FIXTURES: dict[str, Fixture] = {
    "ci": _packaged("ci-results.json", fitted=True),
    "headroom": _packaged("headroom-hold-results.json", fitted=True),
    "stress": _packaged("policies-stress-results.json"),
    "stress-hold": _packaged("stress-hold-results.json"),
    "ci@fast": _packaged("ci-lag-results.json", "cpu-fast", fitted=True, copies_as_measured=True),
    "headroom@fast": _packaged("headroom-lag-results.json", "cpu-fast", fitted=True, copies_as_measured=True),
    "stress@fast": _packaged("stress-lag-results.json", "cpu-fast", copies_as_measured=True),
    "seed4@fast": _packaged("unseen-real-4-lag-results.json", "cpu-fast", copies_as_measured=True),
    "seed6@fast": _packaged("unseen-real-6-lag-results.json", "cpu-fast", copies_as_measured=True),
    "ci@pop": _packaged("ci-pop-results.json", "cpu-fast", fitted=True),
    "headroom@pop": _packaged("headroom-pop-results.json", "cpu-fast", fitted=True),
    "stress@pop": _packaged("stress-pop-results.json", "cpu-fast"),
    "stress2@pop": _packaged("stress-pop2-results.json", "cpu-fast"),
    "shared@pop": _packaged("stress-shared-pop-results.json", "cpu-fast"),
    "seed4@pop": _packaged("unseen-real-4-pop-results.json", "cpu-fast"),
    "seed6@pop": _packaged("unseen-real-6-pop-results.json", "cpu-fast"),
    "seed7@pop": _packaged("unseen-real-7-pop-results.json", "cpu-fast"),
    "seed1@pop": _packaged("unseen-real-1-pop-results.json", "cpu-fast"),
    "seed2@pop": _packaged("unseen-real-2-pop-results.json", "cpu-fast"),
    "seed5@pop": _packaged("unseen-real-5-pop-results.json", "cpu-fast"),
}


#: Stored runs that other studies replay, not validation rows (``benchmarks/no_room_sim.py``).
REPLAYED: tuple[str, ...] = ("stress-headclock-results.json", "stress-headclock-shared-results.json")


def fixtures_in(runs_dir: Path | str) -> dict[str, Fixture]:
    """``FIXTURES`` read from the full results files in ``runs_dir`` (a clone's ``docs/bench``)."""
    return {name: replace(f, path=Path(runs_dir) / f.results_name) for name, f in FIXTURES.items()}


def read_results(path: Traversable) -> Any:
    """A stored run's JSON (gzip when the name ends in ``.gz``); ``StoredRunsMissing`` with a
    one-line message when the file is absent."""
    if not path.is_file():
        where = path.parent if isinstance(path, Path) else PACKAGED
        raise StoredRunsMissing(
            f"stored run {path.name} not found in {where}: --runs-dir (fixtures_in) takes a directory of "
            "full results files, a clone's docs/bench "
            "(tokencake sim --validate --runs-dir DIR, or validate(fixtures_in(DIR)))"
        )
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.name.endswith(".gz") else data)


def calls_from(point: Mapping[str, Any]) -> str:
    """The system whose calls a point's trace is rebuilt from: stock vLLM's where it ran, else the
    first system's (every system replayed the same seeded apps)."""
    return "baseline" if "baseline" in point["systems"] else next(iter(point["systems"]))


def _label(point: Mapping[str, Any]) -> str:
    return str(point.get("base_label", point["label"])).split("#")[0]


_CALL_KEYS = ("run_id", "node", "started", "status", "prompt_tokens", "completion_tokens")
_APP_KEYS = ("run_id", "arrival_s", "e2e_s")
_COPY_KEYS = ("offload_bytes", "offload_s", "upload_bytes", "upload_s")
_ARRIVAL_KEYS = ("run_id", "at_s", "app", "params")
_WORKLOAD_KEYS = ("latency", "arrival")


def _pick(d: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: d[k] for k in keys if k in d}


def _system(system: Mapping[str, Any], name: str, with_calls: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"apps": [_pick(a, _APP_KEYS) for a in system.get("apps", ())]}
    if with_calls:
        out["calls"] = [_pick(c, _CALL_KEYS) for c in system.get("calls", ())]
    summary = ((system.get("extension") or {}).get("summary") or {}) if name == "tokencake" else {}
    if summary:
        out["extension"] = {"summary": _pick(summary, _COPY_KEYS)}
    return out


def compact(results: Mapping[str, Any], source: str = "") -> dict[str, Any]:
    """What the simulator reads of a stored run, in the results file's own layout (see the module
    docstring); ``source`` names the full file it came from."""
    seen: set[str] = set()
    points = []
    for point in results["points"]:
        label = _label(point)
        first = label not in seen
        seen.add(label)
        out: dict[str, Any] = _pick(point, ("label", "base_label"))
        if first:
            workload = point["workload"]
            out["workload"] = {
                **_pick(workload, _WORKLOAD_KEYS),
                "arrivals": [_pick(a, _ARRIVAL_KEYS) for a in workload["arrivals"]],
            }
        calls = calls_from(point)
        out["systems"] = {
            name: _system(system, name, first and name == calls) for name, system in point["systems"].items()
        }
        points.append(out)
    config = results["config"]
    aggregate = {
        key: {"paired": {k: _pick(v, ("ratio", "ci95")) for k, v in (agg.get("paired") or {}).items()}}
        for key, agg in (results.get("aggregate") or {}).items()
    }
    return {
        "kind": "tokencake-sim-fixture",
        "source": source,
        "git_commit": (results.get("versions") or {}).get("git_commit"),
        "preset": results.get("preset"),
        "config": {
            "server": _pick(config["server"], ("device_blocks", "ideal_blocks", "host_pool_blocks")),
            "systems": [_pick(s, ("name", "scheduler")) for s in config.get("systems", ())],
        },
        "points": points,
        "aggregate": aggregate,
    }


def write_compact(runs_dir: Path, out_dir: Path) -> list[Path]:
    """Rewrite the compact copy of every ``FIXTURES`` and ``REPLAYED`` run whose full results file
    is in ``runs_dir`` (gzip with no timestamp, so the same input gives the same bytes). A run whose
    file is absent or trimmed (it has no calls to rebuild a trace from) keeps its packaged copy."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in dict.fromkeys([*(f.results_name for f in FIXTURES.values()), *REPLAYED]):
        path = Path(runs_dir) / name
        if not path.is_file():
            continue
        results = read_results(path)
        if results.get("trimmed"):
            continue
        text = json.dumps(compact(results, name), separators=(",", ":"), sort_keys=False).encode()
        target = out_dir / f"{name}.gz"
        target.write_bytes(gzip.compress(text, compresslevel=9, mtime=0))
        written.append(target)
    return written


if __name__ == "__main__":  # python -m tokencake.sim.stored DOCS_BENCH [OUT_DIR]
    import sys

    src = Path(sys.argv[1])
    dest = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parent / "fixtures"
    for p in write_compact(src, dest):
        print(f"wrote {p} ({p.stat().st_size:,} bytes)")
