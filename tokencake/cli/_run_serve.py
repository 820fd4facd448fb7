"""``tokencake run --serve`` and ``--compare-baseline``: the embedded server for one run, what the
extension did with KV during it, and the side-by-side figures against stock vLLM."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from tokencake.cli._apps_common import cli_error


def embedded_server(args: argparse.Namespace, stack: contextlib.ExitStack, *, baseline: bool = False) -> Any:
    """``tokencake serve`` (``--baseline``: stock vLLM) as a context for one run (stopped after it)."""
    from tokencake.serving import ModelError, Server, ServerError

    try:
        blocks = getattr(args, "device_blocks", None)
        if blocks is not None and blocks < 1:
            raise cli_error("--device-blocks must be >= 1")
        server = stack.enter_context(
            Server(args.model, api_key=args.api_key, num_gpu_blocks=blocks, baseline=baseline, progress=True)
        )
    except (ServerError, ModelError) as exc:
        raise cli_error(str(exc)) from None
    print(f"server ready in {server.startup_s:.0f} s at {server.base_url}", file=sys.stderr, flush=True)
    return server


def print_server_stats(server: Any) -> None:
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


def server_metrics(server: Any) -> dict[str, float]:
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


__all__ = [
    "compare_table",
    "embedded_server",
    "kv_summary",
    "print_server_stats",
    "resumed_turn_latencies",
    "run_figures",
    "server_metrics",
]
