"""Predicted vs measured: the stored real bench runs replayed on the profile of the host they ran on.

Each stored run (``tokencake.sim.stored.FIXTURES``) is a set of real runs: per point, every system
ran the same seeded apps, in interleaved rounds. Its trace is rebuilt (``presets.from_bench_point``),
each system is simulated with the run's own device and host KV sizes, and the prediction is
compared with the measured mean app E2E over the rounds: the error must stay within ``TOLERANCE``
and the systems must rank the same (ties — measured means within ``TIE`` of each other — may come
out either way). ``tests/sim/test_validate.py`` keeps the check.

The stored runs come from two kinds of 2-core host (one computes a token about 2.5 × faster), so
each run names the profile of its host, and each CPU profile is fitted (``fit``) on its own
``ci`` + ``headroom`` runs (``stored.Fixture.fitted``). Only the other, held-out runs test the model:
``errors`` reports them apart from the fitted ones.
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
from tokencake.sim.stored import FIXTURES, Fixture, calls_from, read_results

__all__ = [
    "FIT_GRID",
    "TIE",
    "TOLERANCE",
    "Row",
    "describe",
    "errors",
    "fit",
    "grid_errors",
    "measured_copy_rates",
    "per_run",
    "served_profile",
    "validate",
]

#: How the stored runs were served where the knobs differ from today's defaults: they re-asked
#: every retryable gate "no" at 20 Hz (``reevaluate_max_s`` backs it off while nothing waits).
SERVED_WITH: dict[str, Any] = {"reevaluate_max_s": 0.05}
TOLERANCE = 0.15
#: Measured means closer than this (relative) are a tie: their predicted order is not checked.
TIE = 0.10


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


@dataclass(frozen=True)
class Row:
    """One system of one stored point: measured and predicted mean app E2E. ``fitted``: the row's
    profile was fitted on its run, so its error is not a test of the model."""

    preset: str
    point: str
    system: str
    measured_s: float
    predicted_s: float
    profile: str = "cpu-measured"
    fitted: bool = False

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0


def _label(point: Mapping[str, Any]) -> str:
    return str(point.get("base_label", point["label"])).split("#")[0]


def _measured(results: Mapping[str, Any], label: str, system: str) -> float | None:
    values = [
        statistics.fmean(a["e2e_s"] for a in p["systems"][system]["apps"] if a.get("e2e_s") is not None)
        for p in results["points"]
        if _label(p) == label and system in p["systems"]
    ]
    return statistics.fmean(values) if values else None


def validate(
    fixtures: Mapping[str, Fixture | Path] | None = None, profile: HardwareProfile | None = None
) -> list[Row]:
    """Predicted and measured mean app E2E for every system of every stored run, each on its own
    host's profile unless ``profile`` is given (a bare path is a held-out ``cpu-measured`` run).
    Raises ``StoredRunsMissing`` when a run's file is absent."""
    rows = []
    for preset, fixture in (fixtures or FIXTURES).items():
        if not isinstance(fixture, Fixture):
            fixture = Fixture(Path(fixture))
        results = read_results(fixture.path)
        prof = served_profile(fixture, results, profile or get_profile(fixture.profile))
        server = results["config"]["server"]
        done: set[str] = set()
        for point in results["points"]:
            label = _label(point)
            if label in done:
                continue
            done.add(label)
            trace = from_bench_point(point, calls_from(point))
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
                    # Simulated as it was served: the spatial scheduler only where the run loaded it.
                    ran = next((c for c in results["config"].get("systems", ()) if c.get("name") == name), {})
                    scheduling = "spatial" if ran.get("scheduler") else "priority"
                    spec = replace(spec, options={**spec.options, **SERVED_WITH}, scheduling=scheduling)
                sim = simulate(trace, prof, spec, device_blocks=blocks, host_blocks=hosts)
                rows.append(Row(preset, label, name, measured, sim.e2e_mean_s, prof.name, fixture.fitted))
    return rows


def errors(rows: Iterable[Row]) -> dict[str, dict[str, float | int]]:
    """Worst and mean absolute error of the ``held_out`` rows (the test of the model) and, apart,
    of the ``fitted`` ones (how well the fit took); a side with no rows is left out."""
    out: dict[str, dict[str, float | int]] = {}
    rows = list(rows)
    for side, fitted in (("held_out", False), ("fitted", True)):
        errs = [abs(r.error) for r in rows if r.fitted == fitted]
        if errs:
            out[side] = {
                "rows": len(errs),
                "runs": len({r.preset for r in rows if r.fitted == fitted}),
                "worst": max(errs),
                "mean_abs": statistics.fmean(errs),
            }
    return out


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
        "| preset | point | system | run | measured E2E (s) | predicted (s) | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.preset} | {r.point} | {r.system} | {'fitted' if r.fitted else 'held out'} "
            f"| {r.measured_s:.1f} | {r.predicted_s:.1f} | {r.error:+.0%} |"
        )
    return "\n".join(lines)


def per_run(rows: Iterable[Row]) -> dict[str, dict[str, Any]]:
    """Per stored run: its profile, whether the profile was fitted on it, and its rows' worst and
    mean absolute error."""
    runs: dict[str, list[Row]] = {}
    for r in rows:
        runs.setdefault(r.preset, []).append(r)
    return {
        preset: {
            "profile": group[0].profile,
            "fitted": group[0].fitted,
            "rows": len(group),
            "worst": max(abs(r.error) for r in group),
            "mean_abs": statistics.fmean(abs(r.error) for r in group),
        }
        for preset, group in runs.items()
    }


def describe(summary: Mapping[str, Mapping[str, float | int]]) -> str:
    """``errors``' result in one line per side, the held-out runs first."""
    names = {"held_out": "held-out runs (the test)", "fitted": "fitted runs (not a test)"}
    return "\n".join(
        f"{names[side]}: worst {s['worst']:.1%}, mean |error| {s['mean_abs']:.1%} "
        f"over {s['rows']} rows of {s['runs']} runs"
        for side, s in summary.items()
    )


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
    print(describe(errors(rows)))
    print("\n".join(ranking_violations(rows)) or "ranking: same order as measured (ties excepted)")
