"""``tokencake run APP``: run a bundled app with a live view, then print its summary and answer.

The live view is drawn only on a terminal (``_run_view``); redirected output gets plain lines, and
``--json`` prints exactly one JSON document on stdout (``_run_report``). ``--serve`` and
``--compare-baseline`` start the servers themselves (``_run_serve``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from tokencake.cli._apps_common import build_app, cli_error, console_for, param_value, parse_pairs
from tokencake.cli._run_report import run_document, summary_table
from tokencake.cli._run_serve import (
    compare_table,
    embedded_server,
    print_server_stats,
    run_figures,
    server_metrics,
)
from tokencake.cli._run_view import Progress


def cmd_run(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {k: param_value(v) for k, v in parse_pairs(args.param, "--param").items()}
    for key in ("latency", "seed", "noise", "workdir"):
        if key in params:
            raise cli_error(f"use --{key} instead of --param {key}=…")
    params.update(latency=args.latency, seed=args.seed, noise=args.noise, workdir=args.workdir)
    if getattr(args, "device_blocks", None) is not None and not args.serve:
        raise cli_error("--device-blocks sizes the embedded server: use it with --serve")
    compare = getattr(args, "compare_baseline", False)
    if compare and not args.serve:
        raise cli_error("--compare-baseline starts both servers itself: use it with --serve")
    if compare and args.json:
        raise cli_error("--compare-baseline prints a table: not with --json")
    app = build_app(args.app, params)
    inputs = _inputs(app, args.app, args)
    with contextlib.ExitStack() as stack:
        server = embedded_server(args, stack) if args.serve else None
        llm = _llm(args.app, args, server)
        code, result = _run_and_report(args, app, inputs, llm)
        if server is not None:
            print_server_stats(server)
        figures = run_figures(result, server_metrics(server)) if compare else {}
    if not compare:
        return code
    print("\nthe same run on stock vLLM (--baseline, same device KV):", file=sys.stderr, flush=True)
    with contextlib.ExitStack() as stack:
        base = embedded_server(args, stack, baseline=True)
        base_llm = _llm(args.app, args, base)
        base_code, base_result = _run_and_report(args, build_app(args.app, params), inputs, base_llm)
        base_figures = run_figures(base_result, server_metrics(base))
    console_for(sys.stdout).print(compare_table(figures, base_figures))
    return max(code, base_code)


def _inputs(app: Any, name: str, args: argparse.Namespace) -> dict[str, str]:
    from tokencake.agents import catalog

    values = catalog.default_inputs(name)
    given = parse_pairs(args.input, "--input")
    if args.task is not None:
        given["task"] = args.task
    unknown = sorted(set(given) - set(app.inputs))
    if unknown:
        raise cli_error(
            f"app {name!r} has no input {', '.join(map(repr, unknown))}; inputs: {', '.join(app.inputs)}"
        )
    values.update(given)
    missing = [key for key in app.inputs if not str(values.get(key, "")).strip()]
    if missing:
        first = missing[0]
        hint = "--task TEXT" if first == "task" else f"--input {first}=VALUE"
        raise cli_error(f"app {name!r}: missing required input {first!r} (pass {hint})")
    return values


def _llm(name: str, args: argparse.Namespace, server: Any = None) -> Any:
    import tokencake as tc
    from tokencake.agents import catalog

    if args.scripted:
        return catalog.scripted_llm(name)
    if server is not None:
        return tc.LLM(server.base_url, server.model, args.api_key, events_url=server.events_url or False)
    events: str | bool | None = args.events_url
    if events is None:
        events = os.environ.get("TOKENCAKE_EVENTS_URL") or "auto"
    if events in ("off", "none", "false"):
        events = False
    return tc.LLM(args.base_url, args.model, args.api_key, events_url=events)


def _run_and_report(args: argparse.Namespace, app: Any, inputs: dict[str, str], llm: Any) -> tuple[int, Any]:
    """Run the app with the live view, print its summary (or ``--json``): (exit code, RunResult)."""
    import anyio

    import tokencake as tc

    out_console = console_for(sys.stdout)
    err_console = console_for(sys.stderr)
    live_console = err_console if args.json else out_console
    live = not args.no_live and live_console.is_terminal
    lines = None if (live or args.json) else sys.stderr
    progress = Progress.for_app(app, lines=lines)

    async def main() -> Any:
        if not live:
            return await app.run(llm=llm, observer=progress, timeout=args.timeout, **inputs)
        from rich.live import Live

        with Live(progress, console=live_console, refresh_per_second=8, transient=True):
            return await app.run(llm=llm, observer=progress, timeout=args.timeout, **inputs)

    error: str | None = None
    try:
        result = anyio.run(main)
    except (tc.NodeFailed, tc.RunTimeout) as exc:
        if exc.result is None:
            raise cli_error(str(exc)) from None
        result, error = exc.result, str(exc)
        if "APIConnectionError" in error:
            error += f" (is a server running at {llm.base_url}? use --base-url URL, or --scripted offline)"
    except tc.MissingInput as exc:
        raise cli_error(str(exc)) from None
    if args.trace:
        from tokencake.sim.trace import Trace

        try:
            Trace.from_runs([(0.0, result)], source=f"tokencake run {args.app}").write_jsonl(args.trace)
        except (OSError, ValueError) as exc:
            raise cli_error(f"could not write the trace: {exc}") from None

    if args.json:
        doc = run_document(
            args.app, app, result, inputs=inputs, model=llm.model, latency=args.latency, error=error
        )
        sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
        return (0 if error is None else 1), result
    from rich.text import Text

    out_console.print(summary_table(result))
    stalls = sum(1 for e in result.stall_events if e.type == "stall_begin")
    out_console.print(f"tool calls: {stalls} stalls reported; critical path: {' → '.join(app.critical_path)}")
    if error is not None:
        err_console.print(Text("run failed: ", style="bold red") + Text(error))
        return 1, result
    from rich.panel import Panel

    from tokencake.agents import catalog

    answer = Text(catalog.final_answer(args.app, result.output))
    out_console.print(Panel(answer, title="answer", expand=False))
    return 0, result


__all__ = ["cmd_run"]
