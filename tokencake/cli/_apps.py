"""``tokencake apps``, ``tokencake run APP`` and ``tokencake graph APP``: the bundled catalog.

``run`` shows a live view while the app runs (driven by the run's ``observer`` events), then a
per-node summary and the final answer. The live view is drawn only on a terminal; redirected
output gets plain lines, and ``--json`` prints exactly one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: Version of the ``run --json`` document (bump when a field changes meaning).
RUN_JSON_VERSION = 1

_STATE_STYLE = {
    "waiting": "dim",
    "ready": "dim",
    "running": "cyan",
    "in LLM": "bold cyan",
    "in tool (stalled)": "bold yellow",
    "done": "green",
    "failed": "bold red",
    "cancelled": "red",
}


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


# ---------------------------------------------------------------------- helpers


def _error(message: str) -> Exception:
    from tokencake.cli import CLIError

    return CLIError(message)


def _pairs(items: Sequence[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise _error(f"{what} {item!r} must look like KEY=VALUE")
        out[key.strip()] = value
    return out


def _param_value(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() in ("none", "null"):
        return None
    return text


def _build(name: str, params: dict[str, Any]) -> Any:
    from tokencake.agents import catalog

    try:
        return catalog.get_app(name, **params)
    except catalog.UnknownApp as exc:
        raise _error(str(exc.args[0])) from None
    except (TypeError, ValueError) as exc:
        raise _error(str(exc)) from None


def _console(file: Any) -> Any:
    from rich.console import Console

    terminal = bool(file.isatty()) if hasattr(file, "isatty") else False
    # Off a terminal: no colours, no cursor moves (even with FORCE_COLOR set), and a fixed width
    # so tables stay readable in logs and pipes.
    return Console(
        file=file,
        force_terminal=terminal,
        color_system="auto" if terminal else None,
        width=None if terminal else 120,
        highlight=False,
        soft_wrap=False,
    )


# ---------------------------------------------------------------------- apps


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
    console = _console(sys.stdout)
    console.print(table)
    console.print("Run one: tokencake run NAME --scripted   (or --base-url URL for a real server)")
    return 0


# ---------------------------------------------------------------------- run: live view


@dataclass
class _NodeView:
    state: str = "waiting"
    started: float | None = None
    finished: float | None = None
    llm_s: float = 0.0
    tool_s: float = 0.0
    tokens: int = 0
    detail: str = ""


@dataclass
class Progress:
    """Folds :class:`tokencake.RunEvent` s into per-node states (thread-safe for rich's refresher)."""

    nodes: dict[str, _NodeView]
    started: float = field(default_factory=time.time)
    lines: Any = None  # a file for plain progress lines (no live view), or None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def for_app(cls, app: Any, lines: Any = None) -> Progress:
        import networkx as nx

        order = list(nx.lexicographical_topological_sort(app.graph, key=str))
        return cls({name: _NodeView() for name in order}, lines=lines)

    def __call__(self, event: Any) -> None:
        with self._lock:
            view = self.nodes.get(event.node) if event.node else None
            data = event.data or {}
            kind = event.kind
            if kind == "run_started":
                self.started = event.ts
            if view is None:
                return
            if kind == "node_ready":
                view.state = "ready"
            elif kind == "node_started":
                view.state, view.started = "running", event.ts
            elif kind == "llm_started":
                view.state, view.detail = "in LLM", f"turn {data.get('turn', 0)}"
            elif kind == "llm_finished":
                view.state = "running"
                view.llm_s += float(data.get("latency_s") or 0.0)
                view.tokens += int(data.get("prompt_tokens") or 0) + int(data.get("completion_tokens") or 0)
            elif kind == "tool_started":
                view.state, view.detail = "in tool (stalled)", str(data.get("tool", ""))
            elif kind == "tool_finished":
                view.state = "running"
                view.tool_s += float(data.get("duration_s") or 0.0)
                if data.get("outcome") not in (None, "ok"):
                    view.detail = f"{data.get('tool')}: {data.get('outcome')}"
            elif kind == "node_finished":
                view.state, view.finished, view.detail = "done", event.ts, ""
            elif kind == "node_failed":
                view.state = "cancelled" if data.get("cancelled") else "failed"
                view.finished, view.detail = event.ts, str(data.get("error", ""))[:80]
            if self.lines is not None and kind in ("node_finished", "node_failed"):
                print(
                    f"{event.ts - self.started:8.2f}s  {event.node:<28} {view.state}",
                    file=self.lines,
                    flush=True,
                )

    def __rich__(self) -> Any:
        from rich.table import Table
        from rich.text import Text

        now = time.time()
        with self._lock:
            rows = list(self.nodes.items())
            elapsed = now - self.started
        counts: dict[str, int] = {}
        table = Table(title=f"running… {elapsed:6.1f}s", title_justify="left", expand=False)
        for col in ("node", "state", "elapsed", "LLM s", "tool s", "tokens", ""):
            table.add_column(
                col, justify="right" if col in ("elapsed", "LLM s", "tool s", "tokens") else "left"
            )
        for name, v in rows:
            counts[v.state] = counts.get(v.state, 0) + 1
            if v.started is None:
                took = ""
            else:
                took = f"{(v.finished or now) - v.started:.1f}"
            style = _STATE_STYLE.get(v.state, "")
            table.add_row(
                name,
                Text(v.state, style=style),
                took,
                f"{v.llm_s:.2f}",
                f"{v.tool_s:.2f}",
                str(v.tokens),
                Text(v.detail),
            )
        table.caption = "  ".join(f"{k}: {n}" for k, n in counts.items())
        return table


# ---------------------------------------------------------------------- run


def _inputs(app: Any, name: str, args: argparse.Namespace) -> dict[str, str]:
    from tokencake.agents import catalog

    values = catalog.default_inputs(name)
    given = _pairs(args.input, "--input")
    if args.task is not None:
        given["task"] = args.task
    unknown = sorted(set(given) - set(app.inputs))
    if unknown:
        raise _error(
            f"app {name!r} has no input {', '.join(map(repr, unknown))}; inputs: {', '.join(app.inputs)}"
        )
    values.update(given)
    missing = [key for key in app.inputs if not str(values.get(key, "")).strip()]
    if missing:
        first = missing[0]
        hint = "--task TEXT" if first == "task" else f"--input {first}=VALUE"
        raise _error(f"app {name!r}: missing required input {first!r} (pass {hint})")
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


def _node_rows(result: Any) -> dict[str, dict[str, Any]]:
    rows = {}
    for name, node in result.nodes.items():
        rows[name] = {
            "status": node.status,
            "queue_s": round(node.queue_s, 6),
            "wall_s": round(node.wall_s, 6),
            "llm_s": round(node.llm_s, 6),
            "tool_s": round(node.tool_s, 6),
            "stall_s": round(node.stall_s, 6),
            "llm_calls": node.llm_calls,
            "tool_calls": node.tool_calls,
            "tokens": {
                "prompt": node.usage.prompt_tokens,
                "completion": node.usage.completion_tokens,
                "total": node.usage.total_tokens,
            },
            "error": node.error,
        }
    return rows


def run_document(
    name: str,
    app: Any,
    result: Any,
    *,
    inputs: dict[str, str],
    model: str | None,
    latency: str,
    error: str | None = None,
) -> dict[str, Any]:
    """The ``run --json`` document (see docs/apps.md for the fields)."""
    from tokencake.agents import catalog

    begins = [e for e in result.stall_events if e.type == "stall_begin"]
    ends = {e.stall_id for e in result.stall_events if e.type == "stall_end"}
    full = result.to_dict()  # JSON-able outputs (non-JSON values become their repr)
    output = full["output"] if result.status == "ok" else None
    return {
        "version": RUN_JSON_VERSION,
        "app": name,
        "run_id": result.run_id,
        "status": result.status,
        "error": error,
        "model": model,
        "latency": latency,
        "inputs": inputs,
        "wall_s": round(result.wall_s, 6),
        "critical_path": app.critical_path,
        "usage": {
            "prompt": result.usage.prompt_tokens,
            "completion": result.usage.completion_tokens,
            "total": result.usage.total_tokens,
        },
        "tool_calls": sum(n.tool_calls for n in result.nodes.values()),
        "llm_calls": sum(n.llm_calls for n in result.nodes.values()),
        "stall_events": len(result.stall_events),
        "stall_pairs": sum(1 for b in begins if b.stall_id in ends),
        "nodes": _node_rows(result),
        "outputs": {k: full["nodes"][k]["output"] for k in result.outputs},
        "output": output,
        "answer": catalog.final_answer(name, result.output) if result.status == "ok" else None,
    }


#: The run summary's columns: (title, column of ``RunResult.TIMING_COLUMNS``).
_SUMMARY_COLUMNS = (
    ("node", "node"),
    ("status", "status"),
    ("LLM s", "llm"),
    ("tool s", "tool"),
    ("stall s", "stall"),
    ("tokens", "tokens"),
    ("LLM#", "llm#"),
    ("tool#", "tool#"),
)


def _summary_table(result: Any) -> Any:
    from rich.table import Table

    table = Table(title=f"{result.app}  run {result.run_id}  ({result.wall_s:.2f}s)", title_justify="left")
    index = [result.TIMING_COLUMNS.index(key) for _, key in _SUMMARY_COLUMNS]
    for title, key in _SUMMARY_COLUMNS:
        table.add_column(title, justify="left" if key in ("node", "status") else "right")
    rows, total = result.timing_rows()
    for row in rows:
        table.add_row(*(row[i] for i in index))
    table.add_section()
    table.add_row(*(total[i] for i in index))
    return table


def cmd_run(args: argparse.Namespace) -> int:

    params: dict[str, Any] = {k: _param_value(v) for k, v in _pairs(args.param, "--param").items()}
    for key in ("latency", "seed", "noise", "workdir"):
        if key in params:
            raise _error(f"use --{key} instead of --param {key}=…")
    params.update(latency=args.latency, seed=args.seed, noise=args.noise, workdir=args.workdir)
    if getattr(args, "device_blocks", None) is not None and not args.serve:
        raise _error("--device-blocks sizes the embedded server: use it with --serve")
    compare = getattr(args, "compare_baseline", False)
    if compare and not args.serve:
        raise _error("--compare-baseline starts both servers itself: use it with --serve")
    if compare and args.json:
        raise _error("--compare-baseline prints a table: not with --json")
    app = _build(args.app, params)
    inputs = _inputs(app, args.app, args)
    with contextlib.ExitStack() as stack:
        server = _embedded_server(args, stack) if args.serve else None
        llm = _llm(args.app, args, server)
        code, result = _run_and_report(args, app, inputs, llm)
        if server is not None:
            _print_server_stats(server)
        figures = run_figures(result, _metrics(server)) if compare else {}
    if not compare:
        return code
    print("\nthe same run on stock vLLM (--baseline, same device KV):", file=sys.stderr, flush=True)
    with contextlib.ExitStack() as stack:
        base = _embedded_server(args, stack, baseline=True)
        base_llm = _llm(args.app, args, base)
        base_code, base_result = _run_and_report(args, _build(args.app, params), inputs, base_llm)
        base_figures = run_figures(base_result, _metrics(base))
    _console(sys.stdout).print(compare_table(figures, base_figures))
    return max(code, base_code)


def _embedded_server(args: argparse.Namespace, stack: contextlib.ExitStack, *, baseline: bool = False) -> Any:
    """``tokencake serve`` (``--baseline``: stock vLLM) as a context for one run (stopped after it)."""
    from tokencake.serving import ModelError, Server, ServerError

    try:
        blocks = getattr(args, "device_blocks", None)
        if blocks is not None and blocks < 1:
            raise _error("--device-blocks must be >= 1")
        server = stack.enter_context(
            Server(args.model, api_key=args.api_key, num_gpu_blocks=blocks, baseline=baseline, progress=True)
        )
    except (ServerError, ModelError) as exc:
        raise _error(str(exc)) from None
    print(f"server ready in {server.startup_s:.0f} s at {server.base_url}", file=sys.stderr, flush=True)
    return server


def _print_server_stats(server: Any) -> None:
    """What the extension did with KV during the run (stderr: stdout may be --json)."""
    try:
        stats = server.stats()
    except Exception as exc:  # the run's result matters more than its statistics
        print(f"(server statistics unavailable: {exc})", file=sys.stderr)
        return
    for line in kv_summary(stats.get("counters", {}), stats.get("histograms", {})):
        print(line, file=sys.stderr)


def kv_summary(counters: dict[str, float], histograms: dict[str, Any] | None = None) -> list[str]:
    """The extension's counters as a few lines a user can read: stalls, resumed turns, copies."""

    def n(key: str) -> int:
        return int(counters.get(key, 0) or 0)

    def mb(key: str) -> str:
        return f"{n(key) / 1e6:,.1f} MB"

    stalls = n("events.stall_begin")
    if not stalls:
        return ["extension: no tool calls reported (no stall events), so no KV was moved"]
    decisions = {
        k.removeprefix("stalls.decision."): n(k) for k in sorted(counters) if k.startswith("stalls.decision.")
    }
    kept = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in decisions.items() if v) or "none decided"
    prefix = n("next_turn.prefix_tokens")
    lines = [
        "extension (KV around tool calls):",
        f"  tool calls (stalls): {stalls} · decisions: {kept}",
    ]
    if prefix:
        lines.append(
            f"  resumed turns: {n('next_turn.requests')} · their repeated prefix {prefix:,} tokens = "
            f"device {n('next_turn.prefix_tokens_device'):,} + host {n('next_turn.prefix_tokens_host'):,} "
            f"+ recomputed {n('next_turn.prefix_tokens_recomputed'):,}"
        )
    ttft = (histograms or {}).get("next_turn.ttft_s") or {}
    if ttft.get("count"):
        lines.append(
            f"  resumed turns' time to first token: mean {ttft['mean']:.2f} s · p90 {ttft['p90']:.2f} s "
            f"· max {ttft['max']:.2f} s ({int(ttft['count'])} turns)"
        )
    lines.append(
        f"  copies: offload {mb('offload.bytes')} · prefetch {mb('prefetch.bytes')} "
        f"(on time {n('prefetch.on_time')}, late {n('prefetch.late')}) · "
        f"demand load {n('demand_load.blocks')} blocks · tokens served from host {n('tokens.from_host'):,}"
    )
    if not (n("offload.blocks") or n("prefetch.blocks") or n("demand_load.blocks")):
        lines.append("  (no KV pressure: the device cache held every session, nothing needed moving)")
    return lines


def _run_and_report(args: argparse.Namespace, app: Any, inputs: dict[str, str], llm: Any) -> tuple[int, Any]:
    """Run the app with the live view, print its summary (or ``--json``): (exit code, RunResult)."""
    import anyio

    import tokencake as tc

    out_console = _console(sys.stdout)
    err_console = _console(sys.stderr)
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
            raise _error(str(exc)) from None
        result, error = exc.result, str(exc)
        if "APIConnectionError" in error:
            error += f" (is a server running at {llm.base_url}? use --base-url URL, or --scripted offline)"
    except tc.MissingInput as exc:
        raise _error(str(exc)) from None
    if args.trace:
        from tokencake.sim.trace import Trace

        try:
            Trace.from_runs([(0.0, result)], source=f"tokencake run {args.app}").write_jsonl(args.trace)
        except (OSError, ValueError) as exc:
            raise _error(f"could not write the trace: {exc}") from None

    if args.json:
        doc = run_document(
            args.app, app, result, inputs=inputs, model=llm.model, latency=args.latency, error=error
        )
        sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
        return (0 if error is None else 1), result
    from rich.text import Text

    out_console.print(_summary_table(result))
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


def _metrics(server: Any) -> dict[str, float]:
    """vLLM's ``/metrics`` of an embedded server, or {} (the figures then show "—")."""
    from tokencake.serving import ServerError

    try:
        return dict(server.metrics())
    except ServerError as exc:
        print(f"(server metrics unavailable: {exc})", file=sys.stderr)
        return {}


def resumed_turn_latencies(result: Any) -> list[float]:
    """Client-side latency of each LLM call that came after a tool call of the same node.

    These are the requests whose context sat idle during a tool: what the extension is for.
    """
    after_tool: dict[str | None, bool] = {}
    out = []
    for ev in sorted(result.events, key=lambda e: e.ts):
        if ev.kind == "tool_finished":
            after_tool[ev.node] = True
        elif ev.kind == "llm_finished":
            if after_tool.get(ev.node) and ev.data.get("latency_s") is not None:
                out.append(float(ev.data["latency_s"]))
            after_tool[ev.node] = False
    return out


def run_figures(result: Any, metrics: dict[str, float]) -> dict[str, Any]:
    """What ``--compare-baseline`` puts side by side for one run on one (fresh) server."""
    resumed = resumed_turn_latencies(result)
    return {
        "status": result.status,
        "wall_s": result.wall_s,
        "llm_s": sum(n.llm_s for n in result.nodes.values()),
        "resumed": len(resumed),
        "resumed_mean_s": sum(resumed) / len(resumed) if resumed else None,
        "computed_prompt_tokens": metrics.get('vllm:prompt_tokens_by_source_total{source="local_compute"}'),
        "prompt_tokens": metrics.get("vllm:prompt_tokens_total"),
        "preemptions": metrics.get("vllm:num_preemptions_total"),
    }


def compare_table(ext: dict[str, Any], base: dict[str, Any]) -> Any:
    """TokenCake vs stock vLLM on the same app, inputs and device KV (one run each: indicative)."""
    from rich.table import Table

    def sec(v: float | None) -> str:
        return "—" if v is None else f"{v:.2f} s"

    def num(v: float | None) -> str:
        return "—" if v is None else f"{v:,.0f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "—" if a is None or not b else f"{a / b:.2f}"

    table = Table(title="TokenCake vs stock vLLM (one run each)", title_justify="left")
    for title in ("", "TokenCake", "stock vLLM", "TokenCake / stock"):
        table.add_column(title, justify="left" if not title else "right")
    rows = (
        ("app wall time", "wall_s", sec),
        ("time in LLM calls (all nodes)", "llm_s", sec),
        ("resumed turns (after a tool): mean latency", "resumed_mean_s", sec),
        ("prompt tokens computed (prefill + recompute)", "computed_prompt_tokens", num),
        ("prompt tokens", "prompt_tokens", num),
        ("preemptions", "preemptions", num),
    )
    for title, key, fmt in rows:
        table.add_row(title, fmt(ext.get(key)), fmt(base.get(key)), ratio(ext.get(key), base.get(key)))
    table.add_row("resumed turns", str(ext.get("resumed", 0)), str(base.get("resumed", 0)), "")
    if ext.get("status") != "ok" or base.get("status") != "ok":
        table.caption = f"run status: TokenCake {ext.get('status')}, stock {base.get('status')}"
    return table


# ---------------------------------------------------------------------- graph


def graph_text(app: Any) -> str:
    """A text rendering of the DAG: nodes by depth, their predicted seconds, parents; * = critical."""
    graph = app.graph
    critical = set(app.critical_path)
    lines = [
        f"{app.name}: {graph.number_of_nodes()} nodes, {graph.number_of_edges()} edges, "
        f"critical path {app.critical_path_s:.1f}s predicted (* marks it)",
    ]
    by_depth: dict[int, list[str]] = {}
    for name in graph.nodes:
        by_depth.setdefault(int(graph.nodes[name]["depth"]), []).append(name)
    width = max(len(n) for n in graph.nodes)
    for depth in sorted(by_depth):
        for name in sorted(by_depth[depth]):
            attrs = graph.nodes[name]
            mark = "*" if name in critical else " "
            parents = ", ".join(sorted(graph.predecessors(name))) or "-"
            calls = ",".join(attrs.get("calls") or attrs.get("tools") or []) or "-"
            lines.append(
                f"{depth:>3} {mark} {name:<{width}}  {attrs['kind']:<8} {attrs['weight_s']:6.2f}s"
                f"  tools: {calls:<30}  after: {parents}"
            )
    lines.append("critical path: " + " → ".join(app.critical_path))
    return "\n".join(lines)


def draw_png(app: Any, path: str) -> None:
    """Draw the DAG left to right by depth, the critical path in red (matplotlib, Agg backend)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise _error("--png needs matplotlib (pip install 'tokencake[plot]')") from None
    import networkx as nx

    graph = app.graph
    critical = app.critical_path
    crit_edges = set(itertools.pairwise(critical))
    layers: dict[int, list[str]] = {}
    for name in graph.nodes:
        layers.setdefault(int(graph.nodes[name]["depth"]), []).append(name)
    pos = {}
    for depth, names in layers.items():
        for i, name in enumerate(sorted(names)):
            pos[name] = (float(depth), (len(names) - 1) / 2 - i)
    widest = max(len(names) for names in layers.values())
    fig, ax = plt.subplots(figsize=(max(6.0, 1.05 * len(layers) + 1), max(3.0, 1.0 * widest + 1.5)))
    try:
        colors = [
            "#d62728" if n in critical else ("#1f77b4" if graph.nodes[n]["kind"] == "agent" else "#7f7f7f")
            for n in graph.nodes
        ]
        nx.draw_networkx_nodes(graph, pos, ax=ax, node_color=colors, node_size=180)
        normal = [e for e in graph.edges if e not in crit_edges]
        nx.draw_networkx_edges(
            graph, pos, ax=ax, edgelist=normal, edge_color="#aaaaaa", width=0.8, node_size=180
        )
        nx.draw_networkx_edges(
            graph, pos, ax=ax, edgelist=sorted(crit_edges), edge_color="#d62728", width=2.2, node_size=180
        )
        for name, (x, y) in pos.items():
            label = name.replace("_validate_patch", "\n_validate_patch")
            ax.text(x, y + 0.12, label, fontsize=6.5, ha="center", va="bottom")
        ax.set_title(
            f"{app.name}: {graph.number_of_nodes()} nodes, critical path in red "
            f"({app.critical_path_s:.1f}s predicted); blue = agent, grey = function",
            fontsize=9,
        )
        ax.set_ylim(-widest / 2 - 0.3, widest / 2 + 0.5)
        ax.axis("off")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def cmd_graph(args: argparse.Namespace) -> int:
    params = {k: _param_value(v) for k, v in _pairs(args.param, "--param").items()}
    app = _build(args.app, params)
    if args.png:
        draw_png(app, args.png)
        nodes = app.graph.number_of_nodes()
        print(f"wrote {args.png} ({nodes} nodes, critical path: {' → '.join(app.critical_path)})")
        return 0
    print(graph_text(app))
    return 0


__all__ = ["RUN_JSON_VERSION", "Progress", "draw_png", "graph_text", "register", "run_document"]
