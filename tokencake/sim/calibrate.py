"""The GPU model against what was measured on an H200: step times and pinned copies.

The measurements (real H200, torch bf16; each file's ``provenance`` names its commit) come from two
scripts and are shipped compact as ``fixtures/gpu-h200.json`` (``python -m tokencake.sim.calibrate
--write DIR`` rewrites it from ``DIR``'s full files):

* ``docs/bench/gpu-step.json`` (``scripts/gpu_step.py``): an eager forward of a Llama-3-8B-shaped
  model — prefill chunks of 512 / 2,048 / 8,192 tokens, a 2,048-token chunk after 8,192 / 16,384
  cached ones, decode steps of 1 / 32 / 128 / 256 sequences × 1,024 / 4,096 / 16,384 context;
* ``docs/bench/gpu-overlap-{128,1024,2048}.json`` (``scripts/gpu_overlap.py``): the connector's
  block copies of 128 / 1,024 / 2,048 blocks (2 MiB each) per direction, alone, both directions at
  once, and beside a compute- or HBM-bound kernel.

``fit_step`` fits the five step constants of ``HardwareProfile.step_time`` by least squares on
relative error over every case except the launch-bound ones (``launch_bound``: decode steps within
``LAUNCH_MARGIN`` of the one-sequence time, which stays flat while its KV grows 16 × — the eager
forward's kernel launches, which vLLM's CUDA graphs remove). ``fit_copies`` fits each direction's
rate and per-copy cost to the copies alone, the duplex share to both at once, and the compute
slowdown to the worst step-like kernel slowed beside a copy. ``tests/sim/test_calibrate.py`` holds
``h200-llama3-8b`` to both fits.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokencake.sim.profiles import HardwareProfile
from tokencake.sim.stored import PACKAGED

__all__ = [
    "LAUNCH_MARGIN",
    "MEASUREMENTS",
    "STEP_CONSTANTS",
    "StepCase",
    "compact_measurements",
    "copy_errors",
    "fit_copies",
    "fit_step",
    "fitted_cases",
    "launch_bound",
    "leave_one_out",
    "measurements",
    "report",
    "step_cases",
    "step_errors",
]

MEASUREMENTS = "gpu-h200.json"
#: Full files the compact measurements come from (``docs/bench``).
STEP_FILE = "gpu-step.json"
OVERLAP_FILES = ("gpu-overlap-128.json", "gpu-overlap-1024.json", "gpu-overlap-2048.json")
#: A decode step measured within this share of the one-sequence steps' median is launch-bound.
LAUNCH_MARGIN = 0.10
#: The step constants ``fit_step`` fits, in the order of ``StepCase.terms``.
STEP_CONSTANTS = (
    "step_s",
    "prefill_s_per_token",
    "attn_s_per_token_ctx",
    "decode_s_per_seq",
    "decode_s_per_ctx_token",
)
#: The copy constants ``fit_copies`` fits.
_COPY_CONSTANTS = (
    "d2h_bytes_per_s",
    "h2d_bytes_per_s",
    "copy_base_s",
    "duplex_share",
    "copy_compute_slowdown",
)
#: Step-like kernels beside a copy: a compute-slowdown reading above this is a clock change, not the
#: copy (one matrix-product reading ran "alone" at 775 TFLOP/s against ~680 in every other).
_SLOWDOWN_OUTLIER_PCT = 10.0


@dataclass(frozen=True)
class StepCase:
    """``batch`` sequences, each computing ``new`` tokens after ``context`` cached ones."""

    case: str
    kind: str
    batch: int
    new: int
    context: int
    measured_s: float

    def terms(self) -> tuple[int, int, int, int, int]:
        """The case in ``HardwareProfile.step_time``'s terms (the engine's context convention)."""
        if self.kind == "decode":
            return (1, 0, 0, self.batch, self.batch * self.context)
        pairs = self.batch * self.new * (self.context + self.new // 2)
        return (1, self.batch * self.new, pairs, 0, 0)

    def predicted_s(self, profile: HardwareProfile) -> float:
        _, tokens, pairs, decodes, ctx = self.terms()
        return profile.step_time(tokens, pairs, decodes, ctx)


def measurements() -> dict[str, Any]:
    """The compact H200 measurements shipped with the package."""
    return json.loads((PACKAGED / MEASUREMENTS).read_text())


def step_cases(data: Mapping[str, Any] | None = None) -> list[StepCase]:
    rows = (data or measurements())["step"]
    return [StepCase(r["case"], r["kind"], r["batch"], r["new"], r["context"], r["measured_s"]) for r in rows]


def launch_bound(cases: Sequence[StepCase]) -> set[str]:
    """Decode cases whose time is the launch floor: within ``LAUNCH_MARGIN`` of the median
    one-sequence decode (whose time does not grow with its context)."""
    floor = statistics.median(c.measured_s for c in cases if c.kind == "decode" and c.batch == 1)
    return {c.case for c in cases if c.kind == "decode" and c.measured_s <= floor * (1 + LAUNCH_MARGIN)}


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` by Gaussian elimination with partial pivoting (``a`` square, well conditioned)."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_step(cases: Iterable[StepCase]) -> dict[str, float]:
    """The step constants that minimise the squared relative error over ``cases`` (least squares;
    each column scaled to unit size first so the normal equations stay well conditioned)."""
    rows = [[t / c.measured_s for t in c.terms()] for c in cases]
    k = len(STEP_CONSTANTS)
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    x = [[r[j] / scale[j] for j in range(k)] for r in rows]
    ata = [[sum(r[i] * r[j] for r in x) for j in range(k)] for i in range(k)]
    atb = [sum(r[i] for r in x) for i in range(k)]
    p = _solve(ata, atb)
    return {name: p[j] / scale[j] for j, name in enumerate(STEP_CONSTANTS)}


def fitted_cases(cases: Sequence[StepCase]) -> list[StepCase]:
    """The cases ``fit_step`` is given: all but the launch-bound ones."""
    skip = launch_bound(cases)
    return [c for c in cases if c.case not in skip]


def leave_one_out(cases: Sequence[StepCase]) -> dict[str, float]:
    """Each fitted case's error when the constants are fitted on the other cases only."""
    used = fitted_cases(cases)
    out = {}
    for held in used:
        params = fit_step(c for c in used if c is not held)
        pred = sum(params[name] * t for name, t in zip(STEP_CONSTANTS, held.terms(), strict=True))
        out[held.case] = pred / held.measured_s - 1.0
    return out


def step_errors(profile: HardwareProfile, cases: Sequence[StepCase] | None = None) -> list[dict[str, Any]]:
    """Per measured case: measured and predicted seconds, the error, and whether it was fitted."""
    cases = list(cases or step_cases())
    skip = launch_bound(cases)
    return [
        {
            "case": c.case,
            "measured_s": c.measured_s,
            "predicted_s": c.predicted_s(profile),
            "error": c.predicted_s(profile) / c.measured_s - 1.0,
            "fitted": c.case not in skip,
        }
        for c in cases
    ]


def fit_copies(data: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Copy constants from the measured copies: per direction, bytes/s and seconds per copy from a
    least-squares line through (blocks, seconds) of the copies alone (``copy_base_s``: the two
    directions' mean); ``duplex_share``: both directions at once over the sum of each alone, at
    the largest copy; ``copy_compute_slowdown``: the worst slowdown of a step-like kernel beside a
    copy (readings above ``_SLOWDOWN_OUTLIER_PCT`` excluded)."""
    data = data or measurements()
    block = data["block_bytes"]
    rows = data["copies"]
    out: dict[str, float] = {}
    bases = []
    for direction in ("d2h", "h2d"):
        alone = {r["blocks"]: r["copy_gbps_alone"] for r in rows if r["direction"] == direction}
        xs = sorted(alone)
        ys = [n * block / (alone[n] * 1e9) for n in xs]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        out[f"{direction}_bytes_per_s"] = block / slope
        bases.append(my - slope * mx)
    out["copy_base_s"] = statistics.fmean(bases)
    largest = max(r["blocks"] for r in rows)
    at = {r["direction"]: r["copy_gbps_alone"] for r in rows if r["blocks"] == largest}
    out["duplex_share"] = at["both"] / (at["d2h"] + at["h2d"])
    slowdowns = [
        r["compute_slowdown_while_copying_pct"]
        for r in rows
        if r["compute_slowdown_while_copying_pct"] <= _SLOWDOWN_OUTLIER_PCT
    ]
    out["copy_compute_slowdown"] = max(slowdowns) / 100
    return out


def copy_errors(profile: HardwareProfile, data: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per measured copy alone (direction and blocks; ``both``: that many blocks each way at once),
    measured and modelled seconds and the error. The model runs a copy in ``copy_base_s`` plus its
    bytes at its direction's rate, and ``both`` with each direction ``1 / duplex_share`` as long
    (``tokencake.sim.copies``)."""
    data = data or measurements()
    block = data["block_bytes"]
    alone: dict[tuple[str, int], float] = {}
    for r in data["copies"]:
        alone.setdefault((r["direction"], r["blocks"]), r["copy_gbps_alone"])
    out = []
    for (direction, n), gbps in alone.items():
        ways = ("d2h", "h2d") if direction == "both" else (direction,)
        slower = 1 / profile.duplex_share if direction == "both" else 1.0
        modelled = max(profile.copy_base_s + n * block / getattr(profile, f"{w}_bytes_per_s") for w in ways)
        measured = n * block * len(ways) / (gbps * 1e9)
        row = {"direction": direction, "blocks": n, "measured_s": measured, "predicted_s": modelled * slower}
        out.append(row | {"error": row["predicted_s"] / measured - 1.0})
    return out


def compact_measurements(runs_dir: Path) -> dict[str, Any]:
    """The compact measurements from the full files in ``runs_dir`` (a clone's ``docs/bench``)."""
    step = json.loads((runs_dir / STEP_FILE).read_text())
    overlaps = {name: json.loads((runs_dir / name).read_text()) for name in OVERLAP_FILES}
    copies = []
    for doc in overlaps.values():
        for r in doc["rows"]:
            copies.append(
                {
                    k: r[k]
                    for k in ("direction", "kernel", "blocks", "copy_gbps_alone", "copy_gbps_with_compute")
                }
                | {"compute_slowdown_while_copying_pct": r["compute_slowdown_while_copying_pct"]}
            )
    return {
        "kind": "tokencake-sim-gpu-measurements",
        "sources": [STEP_FILE, *OVERLAP_FILES],
        "device": step["device"],
        "torch": step["torch"],
        "dtype": step["dtype"],
        "commits": {
            name: (doc.get("provenance") or {}).get("commit")
            for name, doc in {STEP_FILE: step, **overlaps}.items()
        },
        "notes": step.get("notes", ""),
        "block_bytes": 2 * 2**20,
        "step": [
            {k: r[k] for k in ("case", "kind", "batch", "new", "context", "measured_s")}
            for r in step["rows"]
            if not r.get("skipped")
        ],
        "copies": copies,
    }


def report(profile: HardwareProfile) -> dict[str, Any]:
    """The calibration of ``profile`` against the packaged measurements: per step case measured,
    modelled, error, fitted or launch-bound, and its leave-one-out error; both fits."""
    data = measurements()
    cases = step_cases(data)
    loo = leave_one_out(cases)
    rows = step_errors(profile, cases)
    fitted = [r for r in rows if r["fitted"]]
    copies = fit_copies(data)
    return {
        "profile": profile.name,
        "measured_on": {k: data[k] for k in ("device", "torch", "dtype", "commits", "sources")},
        "launch_margin": LAUNCH_MARGIN,
        "step": [{**r, "leave_one_out": loo.get(r["case"])} for r in rows],
        "fitted_cases": len(fitted),
        "worst_fitted_error": max(abs(r["error"]) for r in fitted),
        "worst_leave_one_out": max(abs(e) for e in loo.values()),
        "fit_step": fit_step(fitted_cases(cases)),
        "fit_copies": copies,
        "copy_gb_per_s": {d: copies[f"{d}_bytes_per_s"] / 1e9 for d in ("d2h", "h2d")},
        "copy": {f"{r['direction']}/{r['blocks']}": r for r in copy_errors(profile, data)},
        "worst_copy_error": max(abs(r["error"]) for r in copy_errors(profile, data)),
        "profile_constants": {k: getattr(profile, k) for k in (*STEP_CONSTANTS, *_COPY_CONSTANTS)},
        "decode_share": profile.decode_share,
    }


def _text(doc: Mapping[str, Any]) -> str:
    lines = [f"{doc['profile']} step model vs {STEP_FILE} (fit: {doc['fitted_cases']} cases)"]
    for r in doc["step"]:
        case, loo = r["case"], r["leave_one_out"]
        held = f"  leave-one-out {loo:+.1%}" if loo is not None else "  launch-bound, not fitted"
        lines.append(
            f"  {case:28s} measured {r['measured_s'] * 1e3:8.2f} ms"
            f"  model {r['predicted_s'] * 1e3:8.2f} ms  {r['error']:+.1%}{held}"
        )
    for key, r in doc["copy"].items():
        ms = f"measured {r['measured_s'] * 1e3:8.2f} ms  model {r['predicted_s'] * 1e3:8.2f} ms"
        lines.append(f"  copy {key:12s} {ms}  {r['error']:+.1%}")
    lines.append(f"  fit_step: {doc['fit_step']}")
    lines.append(f"  fit_copies: {doc['fit_copies']}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m tokencake.sim.calibrate [--write DOCS_BENCH] [--json OUT]
    import sys

    from tokencake.bench.environment import versions
    from tokencake.sim.profiles import get_profile

    if "--write" in sys.argv:
        src = Path(sys.argv[sys.argv.index("--write") + 1])
        target = Path(__file__).resolve().parent / "fixtures" / MEASUREMENTS
        target.write_text(json.dumps(compact_measurements(src), indent=1) + "\n")
        print(f"wrote {target}")
    doc = report(get_profile("h200-llama3-8b"))
    print(_text(doc))
    if "--json" in sys.argv:
        out = Path(sys.argv[sys.argv.index("--json") + 1])
        env = versions()
        doc = {
            "kind": "tokencake-sim-calibration",
            "git_commit": env.get("git_commit"),
            "git_dirty": env.get("git_dirty"),
            **doc,
        }
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}")
