"""``tokencake sim``: the KV policies on a model of vLLM's engine, at any scale (no server, no vLLM)."""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tokencake.cli import CLIError

#: Kept here so building the parser stays cheap; tests check them against tokencake.sim.
PROFILE_NAMES = ("cpu-measured", "cpu-fast", "h100-llama3-8b", "h200-llama3-8b")
DEFAULT_SYSTEMS = "baseline,offload-all,continuum,infercept,tokencake,ideal"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sim",
        help="simulate the KV policies on a model of vLLM's engine (GPU scale, no server)",
        description=(
            "Replay a trace (a bench preset generated at any size, or a JSONL trace) on a model of vLLM's "
            "step loop with each KV policy's own decision code, and print E2E, throughput, device hit rate "
            "and host traffic per policy. --validate compares the model with the stored real runs. "
            "See docs/simulation.md."
        ),
    )
    p.add_argument("--profile", default="cpu-measured", choices=PROFILE_NAMES, help="hardware profile")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="change one of the profile's constants for this run (repeatable), e.g. "
        "decode_s_per_ctx_token=5.3e-8; the results name the override",
    )
    p.add_argument("--preset", default="stress", choices=("ci", "headroom", "stress"), help="trace shape")
    p.add_argument("--trace", type=Path, help="a JSONL trace to replay instead of a preset")
    p.add_argument(
        "--agents",
        help="agents (stress: workers in total, in fan-in apps of 8; ci/headroom: one-agent apps); "
        "comma-separated for a sweep, e.g. 64,256,1024",
    )
    p.add_argument("--turns", type=int, help="LLM calls per agent")
    p.add_argument("--apps", type=int, help="stress: number of fan-in apps to split the agents into")
    p.add_argument("--context-tokens", type=int, help="private context per agent in tokens")
    p.add_argument(
        "--shared-prefix-tokens", type=int, default=0, help="stress: common system-prompt preamble"
    )
    p.add_argument("--rate", type=float, help="stress: app arrivals per second (Poisson, default 0.25)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policies",
        default=DEFAULT_SYSTEMS,
        help=f"comma-separated systems (default {DEFAULT_SYSTEMS}; also hold-off, stock-connector, "
        "return-reserve, return-reserve-off)",
    )
    p.add_argument(
        "--retry-max-s",
        type=float,
        default=1.0,
        help="a retryable gate 'no' is asked again after 0.05 s, doubling up to this while no request "
        "waits (the connector's reevaluate_max_s, default 1; 0.05 = no back-off, slow at 1,000 agents)",
    )
    p.add_argument(
        "--jobs", type=int, default=0, help="systems simulated in parallel (default: one per core)"
    )
    p.add_argument("--device-blocks", type=int, help="device KV blocks (default: the profile's)")
    p.add_argument("--host-blocks", type=int, help="host-pool blocks (default: the profile's)")
    p.add_argument("--json", type=Path, help="write every result to this JSON file")
    p.add_argument("--out", type=Path, help="write results.json and PNG plots to this directory")
    p.add_argument("--write-trace", type=Path, help="also write the (generated) trace as JSONL")
    p.add_argument(
        "--validate",
        action="store_true",
        help="predicted vs measured mean E2E for the stored real bench runs",
    )
    p.add_argument(
        "--runs-dir",
        type=Path,
        metavar="DIR",
        help="--validate reads the full stored results files from DIR (a clone's docs/bench; default: "
        "the compact copies shipped with the package)",
    )
    p.set_defaults(func=run)


def _with_retry(spec: Any, retry_max_s: float) -> Any:
    if spec.policy is None:
        return spec
    from dataclasses import replace

    return replace(spec, options={**spec.options, "reevaluate_max_s": retry_max_s})


def _agents(text: str | None) -> list[int | None]:
    if not text:
        return [None]
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"--agents takes integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise CLIError("--agents values must be >= 1")
    return values


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tokencake.sim import SYSTEMS, Trace, TraceError, get_profile, simulate
    from tokencake.sim.presets import generate

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # piped to a file: do not squeeze the table to 80 columns
    if args.validate:
        return _validate(console, args.json, args.runs_dir)
    systems = [s.strip() for s in args.policies.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise CLIError(
            f"unknown system(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(SYSTEMS)}"
        )
    from tokencake.sim.profiles import override

    try:
        profile = override(get_profile(args.profile), args.set)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    for flag in ("device_blocks", "host_blocks", "turns", "context_tokens"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag == "host_blocks" else 1):
            raise CLIError(f"--{flag.replace('_', '-')} must be >= {0 if flag == 'host_blocks' else 1}")
    if args.rate is not None and not args.rate > 0:
        raise CLIError("--rate must be > 0 (app arrivals per second)")
    if args.retry_max_s is not None and not args.retry_max_s > 0:
        raise CLIError("--retry-max-s must be > 0")
    points: list[dict[str, Any]] = []
    for agents in _agents(args.agents):
        try:
            if args.trace is not None:
                trace = Trace.read_jsonl(args.trace)
            else:
                trace = generate(
                    args.preset,
                    agents=agents,
                    turns=args.turns,
                    context_tokens=args.context_tokens,
                    apps=args.apps,
                    rate=args.rate,
                    shared_prefix_tokens=args.shared_prefix_tokens,
                    seed=args.seed,
                )
        except (OSError, TraceError, ValueError) as exc:
            raise CLIError(str(exc)) from None
        if args.write_trace is not None:
            trace.write_jsonl(args.write_trace)
        label = f"{trace.num_sessions} agents" if agents is not None else args.preset
        specs = [_with_retry(SYSTEMS[s], args.retry_max_s) for s in systems]
        kw = {"device_blocks": args.device_blocks, "host_blocks": args.host_blocks}
        jobs = args.jobs or min(len(specs), os.cpu_count() or 1)
        if jobs > 1 and len(specs) > 1:
            # Each system is an independent deterministic run: one process per core.
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                futures = [pool.submit(simulate, trace, profile, spec, **kw) for spec in specs]
                results = {s: f.result() for s, f in zip(systems, futures, strict=True)}
        else:
            results = {
                s: simulate(trace, profile, spec, **kw) for s, spec in zip(systems, specs, strict=True)
            }
        point = {
            "label": label,
            "agents": agents,
            "sessions": trace.num_sessions,
            "llm_calls": trace.num_llm_calls,
            "systems": {s: r.to_dict() for s, r in results.items()},
            "ratios": _ratios(results),
        }
        points.append(point)
        _print_point(console, profile.name, point)
    from tokencake.bench.environment import versions

    env = versions()
    doc = {
        "kind": "tokencake-sim",
        # Which code made these numbers (a dirty tree's numbers are not that commit's).
        "git_commit": env.get("git_commit"),
        "git_dirty": env.get("git_dirty"),
        "profile": profile.name,
        "profile_description": profile.description,
        "preset": None if args.trace else args.preset,
        "trace": str(args.trace) if args.trace else None,
        "points": points,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, default=str))
        console.print(f"wrote {args.json}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
        for path in _plots(doc, args.out):
            console.print(f"wrote {path}")
        console.print(f"wrote {args.out / 'results.json'}")
    return 0


def _ratios(results: dict[str, Any]) -> dict[str, float]:
    """Mean E2E of every system over stock vLLM's and over the ideal's (when both ran)."""
    out = {}
    for ref in ("baseline", "ideal"):
        if ref not in results:
            continue
        for name, r in results.items():
            if name != ref and results[ref].e2e_mean_s > 0:
                out[f"{name}/{ref}"] = r.e2e_mean_s / results[ref].e2e_mean_s
    return out


def _print_point(console: Any, profile: str, point: dict[str, Any]) -> None:
    from rich.table import Table

    systems = point["systems"]
    ideal = systems.get("ideal", {}).get("e2e_mean_s")
    base = systems.get("baseline", {}).get("e2e_mean_s")
    table = Table(
        title=f"tokencake sim · {profile} · {point['label']} · {point['llm_calls']} LLM calls",
        title_justify="left",
    )
    for col in (
        "system",
        "E2E mean (s)",
        "E2E p95 (s)",
        "/ ideal",
        "/ baseline",
        "calls/s",
        "device hit",
        "host hits (tok)",
        "computed prompt",
        "preempt",
        "queue wait crit / other (s)",
        "recomputed next-turn",
        "ready",
        "wall (s)",
    ):
        table.add_column(col, justify="left" if col == "system" else "right")
    for name, r in systems.items():
        ext = r.get("extension") or {}
        e2e = r["e2e_mean_s"]

        def pct(v: Any) -> str:
            return f"{v:.0%}" if isinstance(v, int | float) else "—"

        table.add_row(
            name,
            f"{e2e:.2f}",
            f"{r['e2e_p95_s']:.2f}",
            f"{e2e / ideal:.3f}" if ideal else "—",
            f"{e2e / base:.3f}" if base else "—",
            f"{r['throughput_calls_per_s']:.2f}" if r["throughput_calls_per_s"] else "—",
            pct(r["device_hit_rate"]),
            f"{r['host_hit_tokens']:,}",
            f"{r['computed_prompt_tokens']:,}",
            str(r["preemptions"]),
            f"{r.get('queue_wait_critical_mean_s', float('nan')):.2f} / "
            f"{r.get('queue_wait_noncritical_mean_s', float('nan')):.2f}",
            pct(ext.get("next_turn_recomputed_share")),
            pct(ext.get("ready_rate")),
            f"{r['wall_s']:.1f}",
        )
    console.print(table)


def _plots(doc: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = doc["points"]
    systems = list(points[0]["systems"])
    x = [p["sessions"] for p in points]
    metrics = (
        ("e2e_mean_s", "mean app E2E (s)"),
        ("throughput_calls_per_s", "LLM calls / s"),
        ("device_hit_rate", "device prefix hit rate"),
        ("host_hit_tokens", "prompt tokens served from host"),
    )
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title) in zip(axes.flat, metrics, strict=True):
        for s in systems:
            ys = [p["systems"][s].get(key) or 0 for p in points]
            if len(points) == 1:
                ax.bar(s, ys[0])
            else:
                ax.plot(x, ys, marker="o", label=s)
        ax.set_title(title)
        if len(points) > 1:
            ax.set_xlabel("agents")
            ax.set_xscale("log")
        else:
            ax.tick_params(axis="x", rotation=30)
    if len(points) > 1:
        axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"tokencake sim · {doc['profile']}")
    fig.tight_layout()
    path = out / "sim.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _validate(console: Any, json_path: Path | None, runs_dir: Path | None) -> int:
    from tokencake.sim.profiles import get_profile
    from tokencake.sim.stored import StoredRunsMissing, fixtures_in
    from tokencake.sim.validate import (
        TOLERANCE,
        describe,
        errors,
        per_run,
        ranking_violations,
        table,
        validate,
    )

    try:
        rows = validate(fixtures_in(runs_dir) if runs_dir is not None else None)
    except StoredRunsMissing as exc:
        raise CLIError(str(exc)) from None
    console.print(table(rows))
    worst = max(abs(r.error) for r in rows)
    bad = ranking_violations(rows)
    for line in bad:
        console.print(f"[red]ranking: {line}[/red]")
    ok = worst <= TOLERANCE and not bad
    summary = errors(rows)
    if json_path is not None:
        from tokencake.bench.environment import versions

        env = versions()
        doc = {
            "kind": "tokencake-sim-validate",
            # Which code made these numbers (a dirty tree's numbers are not that commit's).
            "git_commit": env.get("git_commit"),
            "git_dirty": env.get("git_dirty"),
            "python": env.get("python"),
            "vllm": env.get("vllm"),
            "command": "tokencake sim --validate"
            + (f" --runs-dir {runs_dir}" if runs_dir is not None else "")
            + f" --json {json_path.name}",
            # The core's orders do not depend on it; recorded so a rerun can match it anyway.
            "pythonhashseed": os.environ.get("PYTHONHASHSEED"),
            "profiles": {name: get_profile(name).__dict__ for name in sorted({r.profile for r in rows})},
            "tolerance": TOLERANCE,
            "worst_error": worst,
            # The held-out rows test the model; the fitted ones only show how well the fit took.
            "errors": summary,
            "runs": per_run(rows),
            "ranking_violations": bad,
            "rows": {f"{r.preset}/{r.system}": r.__dict__ | {"error": r.error} for r in rows},
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=1))
    console.print(describe(summary))
    console.print(
        f"worst error {worst:.1%} (tolerance {TOLERANCE:.0%}); ranking "
        + ("same as measured (ties excepted)" if not bad else "DIFFERS")
        + (" — OK" if ok else " — FAILED")
    )
    return 0 if ok else 1
