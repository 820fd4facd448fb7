"""``tokencake bench``: the side-by-side benchmark (stock vLLM vs TokenCake vs the unbounded-KV ideal)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tokencake.cli import CLIError

#: Kept here (not imported) so that building the CLI parser stays cheap; a test checks it against
#: ``tokencake.bench.presets.PRESETS``.
PRESET_NAMES = ("ci", "headroom", "stress", "paper", "catalog")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark TokenCake against stock vLLM and the unbounded-KV ideal",
        description=(
            "Replay one seeded agent workload against fresh servers, one system at a time, and write "
            "results.json, summary.csv, calls.csv and PNG plots to --out. See docs/benchmarks.md."
        ),
    )
    p.add_argument(
        "--preset",
        default="ci",
        choices=PRESET_NAMES,
        help=(
            "ci (~2 min on 2 cores), headroom (~3 min), stress (fan-in agents, heavy-tailed tools, "
            "two points: ~8 min per round of 3 systems), paper (~2 h on CPU), catalog (bundled apps with "
            "realistic contexts, ~15-20 min estimated); default ci"
        ),
    )
    p.add_argument(
        "--out", type=Path, default=Path("bench-out"), help="output directory (default: bench-out)"
    )
    p.add_argument(
        "--systems",
        help=(
            "comma-separated: baseline,tokencake,ideal (default; tokencake as `tokencake serve` runs "
            "it, with the spatial scheduler), spatial-off (tokencake without it), spatial-order "
            "(its admission order only), reserve-off (without the critical reserve), spare-late "
            "(late admissions also evict other blocks before host-safe critical chains), reserve-arrival "
            "(the critical reserve's wait counted from arrival, not the head of the queue), "
            "apps-side-by-side (the spatial score weighing an app's age 0.1 s per second against 10 s "
            "chain credits: apps that started seconds apart served side by side), static-slack (the "
            "SDK's slack fixed: a branch that queued past it is not moved to the critical path), "
            "remaining-depth-first (the DAG depth left as a credit: of apps that started together, the "
            "deeper first), "
            "prefetch-off (= offload-only), "
            "demand-off, tokencake-roomy (extension with the ideal's KV: its cost without pressure), "
            "baseline-priority, ideal-priority, and the other KV policies in the same server: "
            "offload-all, continuum, infercept, stock-connector, hold-off (tokencake without "
            "holding prefetched chains), return-reserve (room kept ahead of returns forced on; off "
            "on vLLM-CPU by default), continuum-queue "
            "(continuum + its queue order), replicas-affinity and replicas-round-robin (2 replicas "
            "behind vllm-router). NAME@REV is system NAME whose server imports tokencake from git "
            "revision REV of this checkout, with this code's launcher, flags, workload and client "
            "(e.g. tokencake@HEAD~1,tokencake: before and after the last commit); see docs/benchmarks.md"
        ),
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--model", help="model to serve (default: the bundled SmolLM2-135M)")
    g = p.add_argument_group("workload overrides")
    g.add_argument("--apps", type=int, help="number of app arrivals per point")
    g.add_argument("--concurrency", type=int, help="apps in flight (closed loop)")
    g.add_argument("--rates", help="comma-separated arrival rates in apps/s (open loop), e.g. 0.05,0.2,1")
    g.add_argument(
        "--mix",
        help="app mix, e.g. multi_turn=3,deep-research=1 (catalog names, multi_turn or agent_mix)",
    )
    g.add_argument("--arrival", choices=("poisson", "uniform", "concurrent"))
    g.add_argument("--latency", help="tool latency mode: real, paper or scaled:X")
    g.add_argument("--turns", type=int, help="turns per synthetic agent (stress: every worker)")
    g.add_argument(
        "--context-tokens",
        type=int,
        help="private context per synthetic agent in tokens (stress: the base, 1200; see docs)",
    )
    g.add_argument("--max-tokens", type=int, help="output tokens per LLM call (forced, ignore_eos)")
    g.add_argument(
        "--tool-s",
        help="synthetic tool duration: SECONDS or LOW,HIGH (stress: the lognormal median, or LOW,HIGH's mid)",
    )
    g.add_argument("--workers", type=int, help="worker agents per app (stress; default 3)")
    g.add_argument("--points", help="comma-separated subset of the preset's points (stress: hetero,shared)")
    s = p.add_argument_group("server overrides")
    s.add_argument("--device-blocks", type=int, help="device KV blocks of baseline/tokencake (default 40)")
    s.add_argument("--ideal-blocks", type=int, help="device KV blocks of the ideal system")
    s.add_argument("--host-pool-blocks", type=int, help="host pool size of the extension (blocks)")
    s.add_argument("--server-arg", action="append", default=[], help="extra vLLM argument (repeatable)")
    p.add_argument(
        "--repeat",
        type=int,
        help="interleaved rounds: every system runs every point once per round, in an order from a seeded "
        "Latin square, each system in each position equally often (default 5 for headroom and stress, "
        "whose numbers are headlines; 1 otherwise)",
    )
    p.add_argument(
        "--fixed-order",
        action="store_true",
        help="run the systems in the --systems order in every round instead of the seeded Latin-square "
        "orders",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the discarded warm-up request each fresh server gets before its replay",
    )
    o = p.add_argument_group("output")
    o.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    o.add_argument("--kv-interval", type=float, help="seconds between KV-usage samples")
    o.add_argument("--dry-run", action="store_true", help="print the config and workload, start nothing")
    o.add_argument("--report", type=Path, metavar="RESULTS", help="re-render a results.json (no run)")
    p.set_defaults(func=run)


def _floats(text: str | None, flag: str) -> list[float] | None:
    if text is None:
        return None
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise CLIError(f"{flag} needs positive numbers, got {text!r}")
    return values


def _mix(text: str | None) -> dict[str, float] | None:
    if text is None:
        return None
    from tokencake.bench.apps import available_apps

    known = available_apps()
    mix: dict[str, float] = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        name, _, weight = part.partition("=")
        if name not in known:
            raise CLIError(f"--mix: unknown app {name!r}; choose from {', '.join(known)}")
        try:
            mix[name] = float(weight) if weight else 1.0
        except ValueError:
            raise CLIError(f"--mix: weight of {name!r} must be a number, got {weight!r}") from None
    if not mix or all(w <= 0 for w in mix.values()):
        raise CLIError("--mix needs at least one app with a positive weight")
    return mix


def overrides_from(args: argparse.Namespace) -> Any:
    from tokencake.bench.presets import Overrides

    tool = _floats(args.tool_s, "--tool-s")
    if tool is not None and len(tool) not in (1, 2):
        raise CLIError("--tool-s takes SECONDS or LOW,HIGH")
    return Overrides(
        seed=args.seed,
        model=args.model,
        systems=[x.strip() for x in args.systems.split(",") if x.strip()] if args.systems else None,
        apps=args.apps,
        concurrency=args.concurrency,
        rates=_floats(args.rates, "--rates"),
        arrival=args.arrival,
        latency=args.latency,
        turns=args.turns,
        context_tokens=args.context_tokens,
        max_tokens=args.max_tokens,
        tool_s=(tool[0], tool[-1]) if tool else None,
        device_blocks=args.device_blocks,
        ideal_blocks=args.ideal_blocks,
        host_pool_blocks=args.host_pool_blocks,
        kv_interval_s=args.kv_interval,
        repeat=args.repeat,
        fixed_order=args.fixed_order,
        warmup=not args.no_warmup,
        workers=args.workers,
        points=[x.strip() for x in args.points.split(",") if x.strip()] if args.points else None,
        mix=_mix(args.mix),
        extra_server_args=list(args.server_arg),
    )


class _RichProgress:
    """Progress bars: one per (point, system), advanced per finished app."""

    def __init__(self, progress: Any) -> None:
        self._p = progress
        self._tasks: dict[tuple[str, str], Any] = {}

    def system_starting(self, point: str, system: str, total_apps: int) -> None:
        self._tasks[(point, system)] = self._p.add_task(
            f"{point} · {system}: starting server", total=total_apps
        )

    def server_ready(self, point: str, system: str, seconds: float) -> None:
        self._p.update(
            self._tasks[(point, system)], description=f"{point} · {system} (ready in {seconds:.0f} s)"
        )

    def app_done(self, point: str, system: str, ok: bool) -> None:
        self._p.advance(self._tasks[(point, system)])

    def system_done(self, point: str, system: str, seconds: float) -> None:
        self._p.update(
            self._tasks[(point, system)], description=f"{point} · {system}: done in {seconds:.0f} s"
        )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tokencake.bench import presets, report, terminal

    console = Console()
    if args.report is not None:
        path = args.report / "results.json" if args.report.is_dir() else args.report
        try:
            results = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CLIError(f"cannot read {path}: {exc}") from None
        terminal.render(results, console)
        if not args.no_plots:
            report.write_all(results, path.parent, plots=True)
        return 0 if results.get("valid") else 1

    if args.repeat is not None and args.repeat < 1:
        raise CLIError("--repeat must be >= 1")
    try:
        config = presets.build(args.preset, overrides_from(args))
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.dry_run:
        console.print_json(
            json.dumps(
                {"config": config.to_dict(), "workloads": [p.workload.to_dict() for p in config.points]}
            )
        )
        return 0

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tokencake.bench.runner import run_bench

    out: Path = args.out
    console.print(f"[bold]tokencake bench[/] preset={config.preset}: {config.description}")
    console.print(f"systems: {', '.join(s.name for s in config.systems)} · output: {out}")
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
        disable=not sys.stderr.isatty() and not console.is_terminal,
    ) as progress:
        try:
            results = run_bench(
                config, log_dir=out / "logs", progress=_RichProgress(progress), src_dir=out / ".src"
            )
        except ValueError as exc:  # a configuration the launcher cannot express
            raise CLIError(str(exc)) from None
    written = report.write_all(results, out, plots=not args.no_plots)
    terminal.render(results, console)
    console.print("wrote " + ", ".join(str(p) for p in written))
    return 0 if results["valid"] else 1
