"""Predicted vs measured: the stored real bench runs replayed with the ``cpu-measured`` profile.

Each stored ``results.json`` (``docs/bench/``) is a set of real runs: per point, every system ran
the same seeded apps, in interleaved rounds. Its trace is rebuilt (``presets.from_bench_point``),
each system is simulated with the run's own device and host KV sizes, and the prediction is
compared with the measured mean app E2E over the rounds: the error must stay within ``TOLERANCE``
and the systems must rank the same (ties — measured means within ``TIE`` of each other — may come
out either way). ``tests/sim/test_validate.py`` keeps the check.

The 2-core hosts this project runs on differ between sessions (the later ones compute a token about
2.5 x faster), so each stored run names the profile of the host it ran on, and each profile is
fitted on its own ``ci`` + ``headroom`` runs with the rest held out.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokencake.sim.presets import from_bench_point
from tokencake.sim.profiles import HardwareProfile, get_profile
from tokencake.sim.run import SYSTEMS, simulate

__all__ = [
    "FIT_GRID",
    "FIXTURES",
    "TIE",
    "TOLERANCE",
    "Fixture",
    "Row",
    "StoredRunsMissing",
    "fit",
    "fixtures_in",
    "grid_errors",
    "measured_copy_rates",
    "served_profile",
    "validate",
]

#: How the stored runs were served where the knobs have changed since: they re-asked every
#: retryable gate "no" at 20 Hz (before ``reevaluate_max_s`` backed it off while nothing waits).
SERVED_WITH: dict[str, Any] = {"reevaluate_max_s": 0.05}
TOLERANCE = 0.15
#: Measured means closer than this (relative) are a tie: their predicted order is not checked.
TIE = 0.10
#: Where the stored runs are read from unless ``fixtures_in`` names another directory: ``docs/bench``
#: of the clone this package is imported from. They are not package data (about 12 MB, several times
#: the rest of the wheel), so an installed package reads a clone's directory, named explicitly.
_DOCS = Path(__file__).resolve().parents[2] / "docs" / "bench"


class StoredRunsMissing(FileNotFoundError):
    """Stored runs are not where they are read from; the message is one line that says where to look."""


@dataclass(frozen=True)
class Fixture:
    """A stored real run, the profile of the host it ran on, and whether that profile was fitted on it.

    ``copies_as_measured``: replay the run with the copy rates it measured (its extension's bytes ÷
    seconds) instead of the profile's — for runs whose copies were slower than the host's for a
    reason since fixed (offloads into first-touch host pages before the pool was populated at
    start, ``docs/reliability.md``), so they still check the model of everything else.
    """

    path: Path
    profile: str = "cpu-measured"
    fitted: bool = False
    copies_as_measured: bool = False


def measured_copy_rates(results: Mapping[str, Any]) -> dict[str, float]:
    """The run's own offload (device → host) and load (host → device) rates, over every round of
    its ``tokencake`` system; a direction the run never copied keeps the profile's rate."""
    moved = {"d2h_bytes_per_s": [0.0, 0.0], "h2d_bytes_per_s": [0.0, 0.0]}
    for point in results["points"]:
        ext = (point["systems"].get("tokencake") or {}).get("extension") or {}
        summary = ext.get("summary") or {}
        for key, kind in (("d2h_bytes_per_s", "offload"), ("h2d_bytes_per_s", "upload")):
            moved[key][0] += summary.get(f"{kind}_bytes") or 0.0
            moved[key][1] += summary.get(f"{kind}_s") or 0.0
    return {k: b / s for k, (b, s) in moved.items() if b > 0 and s > 0}


def served_profile(fixture: Fixture, results: Mapping[str, Any], prof: HardwareProfile) -> HardwareProfile:
    """``prof`` as the fixture's run was served: at the run's own copy rates where it says so."""
    return prof.with_(**measured_copy_rates(results)) if fixture.copies_as_measured else prof


#: The stored real runs the check uses (name → run).
FIXTURES: dict[str, Fixture] = {
    "ci": Fixture(_DOCS / "ci-results.json", fitted=True),
    "headroom": Fixture(_DOCS / "headroom-hold-results.json", fitted=True),
    "stress": Fixture(_DOCS / "policies-stress-results.json"),
    "stress-hold": Fixture(_DOCS / "stress-hold-results.json"),
    # The faster hosts (from 2026-12-04), before the host pool was populated at start (5865fc5):
    # offloads ran at ~0.13 GB/s into first-touch pages, so they are replayed at their own rates.
    "ci@fast": Fixture(_DOCS / "ci-lag-results.json", "cpu-fast", fitted=True, copies_as_measured=True),
    "headroom@fast": Fixture(
        _DOCS / "headroom-lag-results.json", "cpu-fast", fitted=True, copies_as_measured=True
    ),
    "stress@fast": Fixture(_DOCS / "stress-lag-results.json", "cpu-fast", copies_as_measured=True),
    "seed4@fast": Fixture(_DOCS / "unseen-real-4-lag-results.json", "cpu-fast", copies_as_measured=True),
    "seed6@fast": Fixture(_DOCS / "unseen-real-6-lag-results.json", "cpu-fast", copies_as_measured=True),
    # The same hosts at the current serving code (host pool populated at start).
    "ci@pop": Fixture(_DOCS / "ci-pop-results.json", "cpu-fast", fitted=True),
    "headroom@pop": Fixture(_DOCS / "headroom-pop-results.json", "cpu-fast", fitted=True),
    "stress@pop": Fixture(_DOCS / "stress-pop-results.json", "cpu-fast"),
    "stress2@pop": Fixture(_DOCS / "stress-pop2-results.json", "cpu-fast"),
    "shared@pop": Fixture(_DOCS / "stress-shared-pop-results.json", "cpu-fast"),
    "seed4@pop": Fixture(_DOCS / "unseen-real-4-pop-results.json", "cpu-fast"),
    "seed6@pop": Fixture(_DOCS / "unseen-real-6-pop-results.json", "cpu-fast"),
    "seed7@pop": Fixture(_DOCS / "unseen-real-7-pop-results.json", "cpu-fast"),
    "seed1@pop": Fixture(_DOCS / "unseen-real-1-pop-results.json", "cpu-fast"),
    "seed2@pop": Fixture(_DOCS / "unseen-real-2-pop-results.json", "cpu-fast"),
    "seed5@pop": Fixture(_DOCS / "unseen-real-5-pop-results.json", "cpu-fast"),
}


def fixtures_in(runs_dir: Path | str) -> dict[str, Fixture]:
    """``FIXTURES`` read from ``runs_dir`` (a clone's ``docs/bench``) instead of the default directory."""
    return {name: replace(f, path=Path(runs_dir) / f.path.name) for name, f in FIXTURES.items()}


def _read(path: Path) -> Any:
    """A stored run's JSON; ``StoredRunsMissing`` with a one-line message when the file is absent."""
    if not path.is_file():
        raise StoredRunsMissing(
            f"stored run {path.name} not found in {path.parent}: the stored runs are a clone's docs/bench, "
            "not package data; run from a clone or pass its docs/bench "
            "(tokencake sim --validate --runs-dir DIR, or validate(fixtures_in(DIR)))"
        )
    return json.loads(path.read_text())


@dataclass(frozen=True)
class Row:
    preset: str
    point: str
    system: str
    measured_s: float
    predicted_s: float
    profile: str = "cpu-measured"

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0


def _measured(results: Mapping[str, Any], label: str, system: str) -> float | None:
    values = [
        statistics.fmean(a["e2e_s"] for a in p["systems"][system]["apps"] if a.get("e2e_s") is not None)
        for p in results["points"]
        if p.get("base_label", p["label"]).split("#")[0] == label and system in p["systems"]
    ]
    return statistics.fmean(values) if values else None


def validate(
    fixtures: Mapping[str, Fixture | Path] | None = None, profile: HardwareProfile | None = None
) -> list[Row]:
    """Predicted and measured mean app E2E for every system of every stored run, each on its own
    host's profile unless ``profile`` is given (a bare path is a ``cpu-measured`` run). Raises
    ``StoredRunsMissing`` when a run's file is absent."""
    rows = []
    for preset, fixture in (fixtures or FIXTURES).items():
        if not isinstance(fixture, Fixture):
            fixture = Fixture(Path(fixture))
        results = _read(fixture.path)
        prof = served_profile(fixture, results, profile or get_profile(fixture.profile))
        server = results["config"]["server"]
        done: set[str] = set()
        for point in results["points"]:
            label = point.get("base_label", point["label"]).split("#")[0]
            if label in done:
                continue
            done.add(label)
            trace = from_bench_point(
                point, "baseline" if "baseline" in point["systems"] else next(iter(point["systems"]))
            )
            for name in point["systems"]:
                if name not in SYSTEMS:
                    continue
                measured = _measured(results, label, name)
                if measured is None:
                    continue
                hosts = server.get("host_pool_blocks") or prof.host_blocks
                blocks = server["ideal_blocks"] if SYSTEMS[name].kv == "ideal" else server["device_blocks"]
                spec = SYSTEMS[name]
                if spec.policy is not None:
                    # Simulated as it was served: the spatial scheduler only where the run loaded it
                    # (before it became the default, the stored `tokencake` ran without it).
                    ran = next((c for c in results["config"].get("systems", ()) if c.get("name") == name), {})
                    scheduling = "spatial" if ran.get("scheduler") else "priority"
                    spec = replace(spec, options={**spec.options, **SERVED_WITH}, scheduling=scheduling)
                sim = simulate(trace, prof, spec, device_blocks=blocks, host_blocks=hosts)
                rows.append(Row(preset, label, name, measured, sim.e2e_mean_s, prof.name))
    return rows


def ranking_violations(rows: Iterable[Row]) -> list[str]:
    """Pairs of systems of one point whose predicted order contradicts a measured non-tie."""
    by_point: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        by_point.setdefault((r.preset, r.point), []).append(r)
    out = []
    for (preset, point), group in by_point.items():
        for a in group:
            for b in group:
                if a.measured_s < b.measured_s * (1 - TIE) and not a.predicted_s < b.predicted_s:
                    out.append(
                        f"{preset}/{point}: {a.system} ({a.measured_s:.1f} s) measured faster than "
                        f"{b.system} ({b.measured_s:.1f} s) but predicted "
                        f"{a.predicted_s:.1f} vs {b.predicted_s:.1f}"
                    )
    return out


def table(rows: Iterable[Row]) -> str:
    lines = [
        "| preset | point | system | measured E2E (s) | predicted (s) | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.preset} | {r.point} | {r.system} | {r.measured_s:.1f} | {r.predicted_s:.1f} "
            f"| {r.error:+.0%} |"
        )
    return "\n".join(lines)


def dump(rows: Iterable[Row]) -> str:
    return json.dumps([r.__dict__ | {"error": r.error} for r in rows], indent=1)


#: The grid ``fit`` searches per profile: step overhead (s), prefill s/token, attention s/token/context
#: token, and per decoding sequence (s; the first host's runs have too little decode to fit it).
FIT_GRID: dict[str, dict[str, tuple[float, ...]]] = {
    "cpu-measured": {
        "prefill_s_per_token": (0.0030, 0.0035, 0.0040, 0.0045),
        "step_s": (0.10, 0.15, 0.20),
        "attn_s_per_token_ctx": (0.0, 4e-7, 8e-7, 1.2e-6, 1.6e-6),
        "decode_s_per_seq": (0.0,),
    },
    "cpu-fast": {
        "prefill_s_per_token": (0.0012, 0.0013, 0.0014, 0.0015, 0.0016),
        "step_s": (0.03, 0.04, 0.05, 0.06, 0.07),
        "attn_s_per_token_ctx": (0.0, 2e-7, 4e-7, 6e-7),
        "decode_s_per_seq": (0.0, 0.005, 0.01),
    },
}


def grid_errors(profile: str = "cpu-measured") -> list[tuple[float, dict[str, float]]]:
    """Every point of the profile's ``FIT_GRID`` with its worst error on the profile's fitted runs,
    best first (the others stay held out)."""
    import itertools

    prof = get_profile(profile)
    grid = FIT_GRID[profile]
    fixtures = {n: f for n, f in FIXTURES.items() if f.profile == profile and f.fitted}
    scored = []
    for values in itertools.product(*grid.values()):
        params = dict(zip(grid, values, strict=True))
        rows = validate(fixtures, prof.with_(**params))
        scored.append((max(abs(r.error) for r in rows), params))
    return sorted(scored, key=lambda t: t[0])


def fit(profile: str = "cpu-measured") -> tuple[float, dict[str, float]]:
    """The grid point with the smallest worst-case error on the profile's fitted runs."""
    return grid_errors(profile)[0]


if __name__ == "__main__":  # python -m tokencake.sim.validate [--fit]
    import sys

    if "--fit" in sys.argv:
        for name in FIT_GRID:
            err, params = fit(name)
            print(f"{name}: best on its ci + headroom runs: worst error {err:.1%} at {params}")
    rows = validate()
    print(table(rows))
    print("\n".join(ranking_violations(rows)) or "ranking: same order as measured (ties excepted)")
