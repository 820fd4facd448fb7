"""``tokencake apps``, ``tokencake run APP`` and ``tokencake graph APP``: the bundled catalog.

This module holds the three commands' flags and help text and lists the catalog; ``run`` lives in
``_run`` (its live view, report and embedded servers in ``_run_view``, ``_run_report``,
``_run_serve``), ``graph`` in ``_graph``.
"""

from __future__ import annotations

import argparse
import json
import sys

from tokencake.cli._apps_common import console_for
from tokencake.cli._graph import cmd_graph
from tokencake.cli._run import cmd_run


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("apps", help="list the bundled apps", description="List the bundled apps.")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=cmd_apps)

    p = subparsers.add_parser(
        "run",
        help="run a bundled app with a live progress view",
        description="Run a bundled app against an OpenAI-compatible server (or the scripted model).",
    )
    p.add_argument("app", help="app name (see `tokencake apps`)")
    p.add_argument("--task", help="the task / question / topic (default: the app's example task)")
    p.add_argument("--input", action="append", default=[], metavar="K=V", help="a run input (repeatable)")
    p.add_argument(
        "--param", action="append", default=[], metavar="K=V", help="a build parameter, e.g. branches=4"
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--base-url", help="OpenAI-compatible base URL (default: $TOKENCAKE_BASE_URL or :8000/v1)"
    )
    src.add_argument("--scripted", action="store_true", help="use the app's deterministic offline script")
    src.add_argument(
        "--serve",
        action="store_true",
        help="start the embedded default server for this run (vLLM + TokenCake extension + --model, "
        "default the bundled SmolLM2), stop it afterwards",
    )
    p.add_argument(
        "--device-blocks",
        type=int,
        help="with --serve: device KV cache in blocks (small = KV pressure, where the extension matters)",
    )
    p.add_argument(
        "--compare-baseline",
        action="store_true",
        help="with --serve: then run the same app on stock vLLM (--baseline, same device blocks) and "
        "print both side by side (twice the time)",
    )
    p.add_argument("--model", help="model name (default: the server's first model)")
    p.add_argument("--api-key", help="API key (default: $TOKENCAKE_API_KEY)")
    p.add_argument(
        "--events-url",
        default=None,
        help="stall-events listener URL, 'auto' (base URL port + 1, the default) or 'off'",
    )
    p.add_argument("--latency", default="real", help="tool latency: real | paper | scaled:X (default real)")
    p.add_argument("--seed", type=int, default=None, help="seed for the latency noise")
    p.add_argument("--noise", type=float, default=0.0, help="lognormal sigma of tool latency noise")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--workdir", help="directory for the run's sandbox (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print only a JSON result on stdout")
    p.add_argument("--no-live", action="store_true", help="no live view, even on a terminal")
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="also write the run as a `tokencake sim` trace (JSONL: every LLM call's tokens, every tool's "
        "hint and duration, the DAG)",
    )
    p.set_defaults(func=cmd_run)

    p = subparsers.add_parser(
        "graph", help="draw an app's DAG with its critical path", description="Draw an app's DAG."
    )
    p.add_argument("app", help="app name (see `tokencake apps`)")
    p.add_argument("--png", metavar="FILE", help="write a PNG picture (matplotlib) instead of text")
    p.add_argument("--param", action="append", default=[], metavar="K=V", help="a build parameter")
    p.set_defaults(func=cmd_graph)


def cmd_apps(args: argparse.Namespace) -> int:
    from rich.table import Table

    from tokencake.agents import catalog

    infos = catalog.list_apps()
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], indent=2))
        return 0
    table = Table(title="TokenCake apps", title_justify="left")
    for col in ("name", "shape", "nodes", "description"):
        table.add_column(col, overflow="fold", justify="right" if col == "nodes" else "left")
    for info in infos:
        table.add_row(info.name, info.shape, str(info.nodes), info.description)
    console = console_for(sys.stdout)
    console.print(table)
    console.print("Run one: tokencake run NAME --scripted   (or --base-url URL for a real server)")
    return 0


__all__ = ["cmd_apps", "register"]
