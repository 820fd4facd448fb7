"""The release run set: every release workload on its systems, round after round, at one serving code.

    benchmarks/release.sh                        # create the set (first call) and run what is left
    benchmarks/release.sh --plan-only            # create it: fresh seeds, the plan; run nothing
    benchmarks/release.sh --status               # units done and left, and the time left
    benchmarks/release.sh --workloads ci,stress-hetero --hours 2.5   # part of what is left
    benchmarks/release.sh --summarize            # docs/bench/release/*.json and the README table

A *unit* is one round of one workload: all its systems, each on a fresh server, in that round's
balanced order (``tokencake.bench.runner.system_order``, through ``run_bench(rounds=[r])``). The
manifest (``OUT/manifest.json``) is written when the set is created, before any unit runs, and
holds everything that fixes the set: the serving code (the commit and the git tree of
``tokencake/``, which the servers import), the fresh draws' seeds, the workloads as ``tokencake
bench`` arguments, the plan (every unit with its system order) and each finished unit. A rerun
continues with the units not done; it refuses (one line) when ``tokencake/`` has uncommitted
changes or its tree differs from the manifest's, so every unit measures the same code. Commits that
leave ``tokencake/`` alone (docs, these scripts), change only what no measured process imports
(:data:`UNMEASURED`: the simulator) or only text a reader sees (docstrings, comments, help texts) do
not break the set; each unit records the tree it ran at.

The fresh draws are ``benchmarks/unseen_real.py`` workloads whose seeds are drawn with ``secrets``
at creation and refused when the draw's seed or its workload seed appears anywhere in docs/
(``used_seeds``) or is a preset's; the knobs are stored, so later changes to that script do not
change the set. A unit whose run is not valid (a system that failed, unequal work, failed apps) is
kept under ``attempts`` and runs again on the next call.

Plans (``release_plan.py``): ``full`` is every workload on every system (about 8 h on 2 cores from
the stored runs' medians); ``default`` (about 5 h) cuts what does not bear on the acceptance. The
plan is fixed at creation; ``--plan-only`` and ``--status`` print the estimate; the table says what
was cut. Summaries (``release_report.py``) and the tables (``release_table.py``) are written when a
run finishes the set; a run that stops with units left writes neither, so a partial set never
replaces the published table (``--summarize`` writes them from the finished units, listing every
unfinished one).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from release_plan import (  # type: ignore[import-not-found]
    DRAWS,
    NOT_IN_SET,
    PLANS,
    REFERENCE,
    ROOT,
    ROUNDS,
    Plan,
    ReleaseError,
    Workload,
    bench_config,
    fresh_draws,
    plan_systems,
    stored_priors,
    unit_seconds,
    used_seeds,
    workload_of,
    workloads,
)

import tokencake
from tokencake.bench.environment import utc_now
from tokencake.bench.runner import Progress, run_bench, system_order

DEFAULT_OUT = ROOT.parent / "runs" / "release"
MANIFEST = "manifest.json"
KIND = "tokencake-release-manifest"


# -- serving-code identity ---------------------------------------------------------------------------


def _git(root: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise ReleaseError(f"git {' '.join(args)} failed in {root}: {out.stderr.strip()[:200]}")
    return out.stdout.strip()


#: Folders of ``tokencake/`` that no measured process imports (the bench client, the servers and
#: the apps they run): a set's units stay comparable when only these change
#: (``tests/benchmarks/test_release.py`` checks the imports).
UNMEASURED = ("tokencake/sim/",)
_PATHSPEC = ("--", "tokencake", *(f":(exclude){p}" for p in UNMEASURED))


def identity(root: Path = ROOT) -> dict[str, Any]:
    """The serving code at ``root``: HEAD's commit, the git tree of its ``tokencake/`` and whether
    the measured part of ``tokencake/`` differs from it (tracked changes or files git does not
    ignore)."""
    return {
        "commit": _git(root, "rev-parse", "HEAD"),
        "tokencake_tree": _git(root, "rev-parse", "HEAD:tokencake"),
        "dirty": bool(_git(root, "status", "--porcelain", "--untracked-files=all", *_PATHSPEC)),
    }


#: Keyword arguments whose string only a reader sees (``argparse`` help texts).
_READER_KEYWORDS = frozenset({"help", "description", "epilog"})


def _behaviour(source: str) -> str | None:
    """The AST of a module without what only a reader sees (docstrings, comments, help texts), or
    None where it does not parse: two sources with the same result run the same."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body[0] = ast.Pass()
        if isinstance(node, ast.Call):
            node.keywords = [
                k
                for k in node.keywords
                if k.arg not in _READER_KEYWORDS or not isinstance(k.value, (ast.Constant, ast.JoinedStr))
            ]
    return ast.dump(tree)


def _same_behaviour(recorded_tree: str, tree: str, name: str, root: Path) -> bool:
    """Whether ``name`` is a Python file in both trees whose two versions differ only in text a
    reader sees."""
    if not name.endswith(".py"):
        return False
    try:
        old, new = (_git(root, "show", f"{t}:{name}") for t in (recorded_tree, tree))
    except ReleaseError:  # added or removed
        return False
    before = _behaviour(old)
    return before is not None and before == _behaviour(new)


def measured_changes(recorded_tree: str, tree: str, root: Path = ROOT) -> list[str]:
    """Files of ``tokencake/`` that differ between two of its trees outside :data:`UNMEASURED` in
    more than docstrings, comments and help texts."""
    if recorded_tree == tree:
        return []
    names = _git(root, "diff", "--name-only", recorded_tree, tree).splitlines()
    return [
        n
        for n in names
        if not f"tokencake/{n}".startswith(UNMEASURED) and not _same_behaviour(recorded_tree, tree, n, root)
    ]


def check_identity(recorded: Mapping[str, Any] | None, now: Mapping[str, Any], root: Path = ROOT) -> None:
    """Raise :class:`ReleaseError` unless ``now`` is clean and (given a set's) the same serving code:
    the same ``tokencake/`` tree, or one that differs only in :data:`UNMEASURED`."""
    if now["dirty"]:
        raise ReleaseError(
            "tokencake/ has uncommitted changes: commit or restore them (a set measures one code)"
        )
    if recorded is not None and (
        changed := measured_changes(recorded["tokencake_tree"], now["tokencake_tree"], root)
    ):
        raise ReleaseError(
            f"the serving code differs from the set's: tokencake/ tree {now['tokencake_tree'][:10]} at "
            f"{now['commit'][:7]}, the set's {recorded['tokencake_tree'][:10]} at {recorded['commit'][:7]} "
            f"(tokencake/{changed[0]}{f' and {len(changed) - 1} more' if len(changed) > 1 else ''}); "
            "check out that code or start a new set in another --out"
        )


# -- the manifest ------------------------------------------------------------------------------------


def create(
    out: Path,
    *,
    root: Path = ROOT,
    plan: str = "default",
    rounds: int = ROUNDS,
    draws: int = DRAWS,
    randbits: Callable[[int], int] = secrets.randbits,
    make_workloads: Callable[[Plan, Sequence[Mapping[str, Any]]], list[Workload]] = workloads,
) -> dict[str, Any]:
    """Create the set in ``out``: draw the seeds, fix the plan, write the manifest; runs nothing."""
    if (out / MANIFEST).exists():
        raise ReleaseError(f"{out / MANIFEST} exists: the set is created once")
    ident = identity(root)
    check_identity(None, ident)
    used = used_seeds(root)
    drawn = fresh_draws(draws, used, randbits)
    chosen = plan_systems(plan, draws)
    ws = make_workloads(chosen, drawn)
    units = []
    for rep in range(rounds):
        for w in ws:
            config = bench_config(w, rounds)
            order = [s.name for s in system_order(config, rep, config.points[0].label)]
            units.append(
                {"unit": f"{w.name}#{rep + 1}", "workload": w.name, "round": rep + 1, "order": order}
            )
    manifest = {
        "kind": KIND,
        "created": utc_now(),
        "identity": {k: ident[k] for k in ("commit", "tokencake_tree")},
        "seeds": {
            "draws": [d["seed"] for d in drawn],
            "workload_seeds": [d["knobs"]["seed"] for d in drawn],
            "how": "secrets.randbits(32), refused when in docs/ or the presets (checked against "
            f"{len(used)} recorded numbers)",
        },
        "plan": {"name": chosen.name, "cut": chosen.cut, "not_in_set": NOT_IN_SET, "rounds": rounds},
        "reference": REFERENCE,
        "workloads": [asdict(w) for w in ws],
        "units": units,
        "done": {},
        "attempts": [],
    }
    save(out, manifest)
    return manifest


def load(out: Path) -> dict[str, Any]:
    path = out / MANIFEST
    if not path.is_file():
        raise ReleaseError(f"no release set in {out} (create one with --plan-only or a plain run)")
    manifest = json.loads(path.read_text())
    if manifest.get("kind") != KIND:
        raise ReleaseError(f"{path} is not a release manifest")
    return manifest


def save(out: Path, manifest: Mapping[str, Any]) -> None:
    """Write the manifest atomically (a run interrupted mid-write keeps the previous one)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(out / MANIFEST)


# -- running -----------------------------------------------------------------------------------------


class LineProgress(Progress):
    """One line per server start and finished system."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log

    def server_ready(self, point: str, system: str, seconds: float) -> None:
        self.log(f"  {point} · {system}: server ready in {seconds:.0f} s")

    def system_done(self, point: str, system: str, seconds: float) -> None:
        self.log(f"  {point} · {system}: done in {seconds:.0f} s")


def left(manifest: Mapping[str, Any], only: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """The units not done, in plan order (of the ``only`` workloads, when given)."""
    chosen = set(only) if only else None
    return [
        u
        for u in manifest["units"]
        if u["unit"] not in manifest["done"] and (chosen is None or u["workload"] in chosen)
    ]


def run(
    out: Path,
    *,
    root: Path = ROOT,
    only: Sequence[str] | None = None,
    hours: float | None = None,
    bench: Callable[..., dict[str, Any]] = run_bench,
    bench_kwargs: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = print,
    clock: Callable[[], float] = time.time,
    priors: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the units not done (of ``only``), each once, stopping before one that would end past
    ``hours``; returns the manifest. Every unit checks the serving code first."""
    manifest = load(out)
    names = [w["name"] for w in manifest["workloads"]]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise ReleaseError(f"unknown workload(s) {', '.join(unknown)}; the set has {', '.join(names)}")
    check_identity(manifest["identity"], identity(root), root)
    start = clock()
    for unit in left(manifest, only):
        w = workload_of(manifest, unit["workload"])
        guess = unit_seconds(manifest, w, priors)
        if hours is not None and clock() - start + guess > hours * 3600:
            log(f"stopping: {unit['unit']} (~{guess / 60:.0f} min) would end past the {hours:g} h budget")
            break
        now = identity(root)
        check_identity(manifest["identity"], now, root)
        config = bench_config(w, manifest["plan"]["rounds"])
        order = [s.name for s in system_order(config, unit["round"] - 1, config.points[0].label)]
        if order != unit["order"]:
            raise ReleaseError(
                f"{unit['unit']}: the planned order {unit['order']} is not the runner's {order}"
            )
        log(f"{unit['unit']} ({', '.join(order)})")
        t0 = clock()
        results = bench(
            config,
            rounds=[unit["round"] - 1],
            log_dir=out / "logs" / w.name,
            progress=LineProgress(log),
            **(bench_kwargs or {}),
        )
        path = Path("units") / w.name / f"round-{unit['round']}.json"
        if not results["valid"]:
            path = path.with_name(f"round-{unit['round']}-attempt-{len(manifest['attempts']) + 1}.json")
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(json.dumps(results) + "\n")
        record = {
            "unit": unit["unit"],
            "file": str(path),
            "finished": utc_now(),
            "wall_s": round(clock() - t0, 1),
            "systems": len(order),
            "commit": results["versions"].get("git_commit"),
            "tokencake_tree": now["tokencake_tree"],
        }
        if results["valid"]:
            manifest["done"][unit["unit"]] = record
        else:
            manifest["attempts"].append({**record, "warnings": results["warnings"][:5]})
            log(f"{unit['unit']}: not valid, kept as an attempt; it runs again on the next call")
        save(out, manifest)
    return manifest


def status(manifest: Mapping[str, Any], priors: Mapping[str, Any] | None) -> str:
    """Done and left per workload, and the time left (from the units done, else the stored runs)."""
    ident, plan = manifest["identity"], manifest["plan"]
    lines = [
        f"serving code {ident['commit'][:7]} (tokencake/ tree {ident['tokencake_tree'][:10]}), plan "
        f"{plan['name']}, {plan['rounds']} rounds; draw seeds "
        + ", ".join(map(str, manifest["seeds"]["draws"])),
        f"{'workload':<14} {'systems':>7} {'done':>6}  left (~h)",
    ]
    total = 0.0
    for d in manifest["workloads"]:
        w = workload_of(manifest, d["name"])
        todo = left(manifest, [w.name])
        hours = len(todo) * unit_seconds(manifest, w, priors) / 3600
        total += hours
        done = plan["rounds"] - len(todo)
        lines.append(
            f"{w.name:<14} {len(w.systems):>7} {done:>3}/{plan['rounds']:<2}  {len(todo)} ({hours:.1f})"
        )
    n_left = len(left(manifest))
    basis = f"{len(manifest['done'])} units done" if manifest["done"] else "the stored runs in docs/bench"
    lines.append(
        f"{len(manifest['done'])} of {len(manifest['units'])} units done, {n_left} left: ~{total:.1f} h "
        f"(from {basis}); {len(manifest['attempts'])} invalid attempt(s)"
    )
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------------


def _check_import() -> None:
    """The servers must import the tree the manifest names: this checkout's, also in subprocesses."""
    imported = Path(tokencake.__file__).resolve().parent
    if imported != ROOT / "tokencake":
        raise ReleaseError(
            f"tokencake is imported from {imported.parent}, not {ROOT}: run benchmarks/release.sh"
        )
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, paths)])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"the set's directory (default {DEFAULT_OUT})"
    )
    ap.add_argument("--plan", choices=PLANS, default="default", help="at creation: which systems run where")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--plan-only", action="store_true", help="create the set if needed, print the plan")
    mode.add_argument("--status", action="store_true", help="units done and left, time left")
    mode.add_argument("--summarize", action="store_true", help="write the summaries and the tables only")
    ap.add_argument("--workloads", help="comma-separated: run only these workloads' units now")
    ap.add_argument("--hours", type=float, help="start no unit that would end past this many hours")
    ap.add_argument(
        "--docs",
        nargs="*",
        type=Path,
        help="files whose release-table block to fill (default: README.md and docs/benchmarks.md, "
        "skipping one without the markers)",
    )
    args = ap.parse_args(argv)
    try:
        _check_import()
        if args.summarize:
            return _summarize(args)
        if not (args.out / MANIFEST).exists():
            if args.status:
                raise ReleaseError(f"no release set in {args.out}")
            create(args.out, plan=args.plan)
            print(f"created {args.out / MANIFEST}")
        manifest = load(args.out)
        priors = None if manifest["done"] else stored_priors()
        if args.plan_only or args.status:
            try:
                check_identity(manifest["identity"], identity())
            except ReleaseError as exc:
                print(f"note: a run would refuse: {exc}")
            if args.plan_only:
                for u in manifest["units"]:
                    print(f"{u['unit']:<18} {' '.join(u['order'])}")
            print(status(manifest, priors))
            return 0
        only = [x.strip() for x in args.workloads.split(",") if x.strip()] if args.workloads else None
        manifest = run(args.out, only=only, hours=args.hours, priors=priors)
        print(status(manifest, None))
        if left(manifest):
            # A partial set must not replace the published table: a rerun continues it, and
            # --summarize writes the summaries from the finished units when that is wanted.
            print("the set is not complete: summaries and tables are written when it is")
            return 0
        return _summarize(args)
    except ReleaseError as exc:
        print(f"release: error: {exc}", file=sys.stderr)
        return 2


def _summarize(args: argparse.Namespace) -> int:
    from release_table import write_all  # type: ignore[import-not-found]

    manifest, head = load(args.out), identity()
    head["measured_changes"] = measured_changes(
        manifest["identity"]["tokencake_tree"], head["tokencake_tree"]
    )
    try:
        written = write_all(manifest, args.out, docs=args.docs, strict=args.docs is not None, head=head)
    except ValueError as exc:  # a named file without the release-table markers
        raise ReleaseError(str(exc)) from None
    for line in written:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
