"""The release run set's plan: its workloads and systems, the fresh draws' seeds, the time it takes.

Plans (:data:`PLANS`): ``full`` is every workload on every system; ``default`` cuts the three other
KV policies from headroom, stress-shared and the draws, and stock FCFS from stress-shared and the
draws: every workload keeps TokenCake and both controls (stock+priority and the reference). Times
come from the units done, else from the stored runs in docs/bench (:func:`stored_priors`).
"""

from __future__ import annotations

import json
import random
import re
import secrets
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import unseen_real  # type: ignore[import-not-found]

from tokencake.bench import presets
from tokencake.bench.runner import BenchConfig

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 5
DRAWS = 3
#: TokenCake's own scheduler with KV that never evicts: the bound reordering cannot beat.
REFERENCE = "tokencake-roomy"
#: Stock FCFS (what users run today), stock with TokenCake's priority scheduling, TokenCake, reference.
HEADLINE = ("baseline", "baseline-priority", "tokencake", REFERENCE)
#: The other KV policies in the same server.
POLICIES = ("offload-all", "continuum", "infercept")
ALL_SYSTEMS = (*HEADLINE, *POLICIES)
#: TokenCake with both controls: stock with the same (priority) scheduling and the reference.
CONTROLS = ("baseline-priority", "tokencake", REFERENCE)
#: The connector's cost without pressure: the reference against stock vLLM with its KV and scheduling.
NO_PRESSURE = ("ideal-priority", REFERENCE)
#: Presets that are not in the set (too long on 2 cores): the table says so.
NOT_IN_SET = {"paper": "a QPS sweep of about 2 h per system", "catalog": "about 5 min per system-run"}


class ReleaseError(Exception):
    """An expected refusal: printed as one line, exit code 2."""


@dataclass(frozen=True)
class Workload:
    """One workload of the set: ``tokencake bench`` arguments (no systems, rounds or output)."""

    name: str
    title: str
    argv: tuple[str, ...]
    systems: tuple[str, ...]
    #: A fresh draw: ``{"seed": draw seed, "knobs": unseen_real's knobs}``.
    draw: dict[str, Any] | None = None
    #: What the row measures: "pressure" (TokenCake against the controls) or "no-pressure".
    role: str = "pressure"

    @property
    def kind(self) -> str:
        """The stored runs a time estimate draws on: the preset, or ``draw``."""
        return "draw" if self.draw else self.argv[self.argv.index("--preset") + 1]


@dataclass
class Plan:
    """Which systems run where; ``cut`` says what the full set has that this plan does not."""

    name: str
    systems: dict[str, tuple[str, ...]]
    cut: list[str] = field(default_factory=list)


def plan_systems(name: str, n_draws: int = DRAWS) -> Plan:
    """The systems per workload of plan ``name`` (``default`` or ``full``); draws are ``draw-<i>``."""
    fixed = ("ci", "headroom", "stress-hetero", "stress-shared")
    draws = tuple(f"draw-{i + 1}" for i in range(n_draws))
    if name == "full":
        return Plan(name, {**{w: ALL_SYSTEMS for w in (*fixed, *draws)}, "no-pressure": NO_PRESSURE})
    if name != "default":
        raise ReleaseError(f"unknown plan {name!r}; choose from {', '.join(PLANS)}")
    systems = {"ci": ALL_SYSTEMS, "stress-hetero": ALL_SYSTEMS, "headroom": HEADLINE}
    systems |= {"stress-shared": CONTROLS, "no-pressure": NO_PRESSURE}
    systems |= {w: CONTROLS for w in draws}
    return Plan(
        name,
        systems,
        cut=[
            f"{', '.join(POLICIES)} not run on headroom, stress-shared and the draws",
            "stock FCFS (baseline) not run on stress-shared and the draws",
        ],
    )


PLANS = ("default", "full")


def workloads(plan: Plan, draws: Sequence[Mapping[str, Any]]) -> list[Workload]:
    """The set's workloads in run order: the presets, both stress points, the draws, no pressure."""
    out = [
        Workload("ci", "ci (6 agents at once)", ("--preset", "ci"), plan.systems["ci"]),
        Workload(
            "headroom", "headroom (6 agents, 6 turns)", ("--preset", "headroom"), plan.systems["headroom"]
        ),
    ]
    for point in ("hetero", "shared"):
        argv = ("--preset", "stress", "--points", point)
        out.append(Workload(f"stress-{point}", f"stress, {point}", argv, plan.systems[f"stress-{point}"]))
    for i, d in enumerate(draws):
        name = f"draw-{i + 1}"
        out.append(
            Workload(
                name,
                draw_title(i + 1, d),
                tuple(unseen_real.bench_args(d["knobs"])),
                plan.systems[name],
                dict(d),
            )
        )
    out.append(
        Workload(
            "no-pressure",
            "ci on the reference's KV, 6 agents at once",
            ("--preset", "ci"),
            plan.systems["no-pressure"],
            role="no-pressure",
        )
    )
    return out


def draw_title(i: int, d: Mapping[str, Any]) -> str:
    k = d["knobs"]
    return (
        f"fresh draw {i} (seed {d['seed']}): {k['point']}, {k['apps']} apps × {k['workers']} workers, "
        f"{k['turns']} turns, {k['tool_s']:g} s tools, {k['device_blocks']} blocks"
    )


# -- fresh seeds -------------------------------------------------------------------------------------

_SEED_TEXT = re.compile(r"seed", re.I)
_SEED_NAME = re.compile(r"(?:seed|unseen-real-)[-_]?(\d+)", re.I)
_INT = re.compile(r"\d+")


def used_seeds(root: Path = ROOT) -> set[int]:
    """Every seed recorded in docs/ and the presets: values under JSON keys naming a seed, numbers in
    names after ``seed`` or ``unseen-real-``, and numbers within 60 characters after the word "seed"
    in text. Generous on purpose: a number that is not a seed only makes a draw retry."""
    found = {presets.Overrides().seed}
    for path in sorted((root / "docs").rglob("*")):
        if not path.is_file() or path.suffix in (".png", ".ipynb"):
            continue
        found.update(int(m) for m in _SEED_NAME.findall(path.name))
        text = path.read_text(errors="replace")
        if path.suffix == ".json":
            try:
                found.update(_json_seeds(json.loads(text), False))
                continue
            except ValueError:
                pass
        for m in _SEED_TEXT.finditer(text):
            found.update(int(n) for n in _INT.findall(text[m.end() : m.end() + 60]))
    return found


def _json_seeds(node: Any, under_seed: bool) -> Iterable[int]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _json_seeds(v, under_seed or "seed" in str(k).lower())
    elif isinstance(node, list):
        for v in node:
            yield from _json_seeds(v, under_seed)
    elif under_seed and isinstance(node, int) and not isinstance(node, bool):
        yield node
    elif under_seed and isinstance(node, str):
        yield from (int(n) for n in _INT.findall(node))


def fresh_draws(
    n: int, used: set[int], randbits: Callable[[int], int] = secrets.randbits
) -> list[dict[str, Any]]:
    """``n`` draws of ``unseen_real`` whose draw seed and workload seed are in neither ``used`` nor
    each other; each ``{"seed", "knobs"}``."""
    out: list[dict[str, Any]] = []
    taken = set(used)
    while len(out) < n:
        seed = randbits(32)
        knobs = unseen_real.draw(random.Random(f"unseen-real:{seed}"))
        if seed in taken or knobs["seed"] in taken:
            continue
        taken |= {seed, knobs["seed"]}
        out.append({"seed": seed, "knobs": knobs})
    return out


def bench_config(w: Workload, rounds: int) -> BenchConfig:
    """The workload's bench configuration, built as ``tokencake bench`` builds it from its arguments."""
    from tokencake.cli import CLIError, build_parser
    from tokencake.cli._bench import overrides_from

    argv = ["bench", *w.argv, "--systems", ",".join(w.systems), "--repeat", str(rounds)]
    try:
        args = build_parser().parse_args(argv)
        config = presets.build(args.preset, overrides_from(args))
    except (CLIError, ValueError) as exc:
        raise ReleaseError(f"workload {w.name}: {exc}") from None
    if len(config.points) != 1:
        raise ReleaseError(f"workload {w.name} has {len(config.points)} points; a unit runs one")
    return config


def workload_of(manifest: Mapping[str, Any], name: str) -> Workload:
    d = next(w for w in manifest["workloads"] if w["name"] == name)
    return Workload(**{**d, "argv": tuple(d["argv"]), "systems": tuple(d["systems"])})


# -- time ---------------------------------------------------------------------------------------------


def stored_priors(results_dir: Path = ROOT / "docs" / "bench") -> dict[str, Any]:
    """Seconds per system-run from the stored bench runs (server start + replay), medians by
    (workload kind, system) and by kind, with the median ratio of a run's wall time to their sum."""
    by_system: dict[str, list[float]] = {}
    by_kind: dict[str, list[float]] = {}
    overhead: list[float] = []
    for path in sorted(results_dir.glob("*-results.json")):
        data = json.loads(path.read_text())
        if data.get("kind") != "tokencake-bench":
            continue
        kind = "draw" if path.name.startswith("unseen-real") else data.get("preset", "")
        runs = [
            (name, (s.get("replay_s") or 0.0) + (s.get("server_start_s") or 0.0))
            for p in data["points"]
            for name, s in p["systems"].items()
        ]
        for name, seconds in runs:
            by_system.setdefault(f"{kind}:{name}", []).append(seconds)
            by_kind.setdefault(kind, []).append(seconds)
        total = sum(s for _n, s in runs)
        if total and data.get("wall_s"):
            overhead.append(data["wall_s"] / total)
    return {
        "system": {k: statistics.median(v) for k, v in by_system.items() if len(v) >= 3},
        "kind": {k: statistics.median(v) for k, v in by_kind.items()},
        "overhead": statistics.median(overhead) if overhead else 1.0,
    }


def unit_seconds(manifest: Mapping[str, Any], w: Workload, priors: Mapping[str, Any] | None) -> float:
    """Expected wall time of one unit of ``w``: the mean of its units done; else the mean seconds per
    system-run of every unit done; else the stored runs' medians (``priors``; 0 without them)."""
    done = [d for d in manifest["done"].values() if d["unit"].rsplit("#", 1)[0] == w.name]
    if done:
        return statistics.mean(d["wall_s"] for d in done)
    everything = list(manifest["done"].values())
    if everything:
        return len(w.systems) * sum(d["wall_s"] for d in everything) / sum(d["systems"] for d in everything)
    if not priors:
        return 0.0
    kind = priors["kind"].get(w.kind) or statistics.median(priors["kind"].values())

    def one(system: str) -> float:
        for name in (system, PRIOR_LIKE.get(system)):
            if f"{w.kind}:{name}" in priors["system"]:
                return priors["system"][f"{w.kind}:{name}"]
        return kind

    return priors["overhead"] * sum(one(s) for s in w.systems)


#: A system with few stored runs is timed like the one it shares its KV size and pressure with.
PRIOR_LIKE = {"baseline-priority": "baseline", REFERENCE: "ideal", "ideal-priority": "ideal"}
