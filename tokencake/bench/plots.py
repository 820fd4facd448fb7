"""The PNG plots of a report: E2E CDFs, KV usage over time, per-node time, and the load sweep."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tokencake.bench.tables import lookup


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(n: int) -> tuple[int, int]:
    cols = min(n, 3)
    return (n + cols - 1) // cols, cols


def _per_point_panels(
    results: Mapping[str, Any],
    path: Path,
    draw: Callable[[Any, str, Mapping[str, Any]], None],
    *,
    xlabel: str,
    ylabel: str,
    ylim: tuple[float, float],
) -> None:
    """One panel per workload point, ``draw(ax, system_name, system)`` once per system in it."""
    plt = _plt()
    points = results["points"]
    rows, cols = _grid(len(points))
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax, point in zip(axes.flat, points, strict=False):
        for name, s in point["systems"].items():
            draw(ax, name, s)
        ax.set_title(point["label"])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(points) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_e2e_cdf(results: Mapping[str, Any], path: Path) -> None:
    """Empirical CDF of app E2E latency, one line per system, one panel per point."""

    def draw(ax: Any, name: str, s: Mapping[str, Any]) -> None:
        xs = sorted(a["e2e_s"] for a in s["apps"] if a.get("status") == "ok")
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)

    _per_point_panels(
        results, path, draw, xlabel="app E2E latency (s)", ylabel="fraction of apps", ylim=(0, 1.02)
    )


def plot_kv_usage(results: Mapping[str, Any], path: Path) -> None:
    """Device KV usage (vLLM's gauge) over the replay, one line per system, one panel per point."""

    def draw(ax: Any, name: str, s: Mapping[str, Any]) -> None:
        series = s["kv"]["series"]
        blocks = s.get("num_gpu_blocks")
        ax.plot(
            [p["t"] for p in series],
            [100 * p["kv_usage"] for p in series],
            label=f"{name} ({blocks} blocks)" if blocks else name,
        )

    _per_point_panels(
        results, path, draw, xlabel="time since replay start (s)", ylabel="device KV usage (%)", ylim=(0, 105)
    )


_PARTS = (("llm_s", "LLM"), ("tool_s", "tool (stall)"), ("queue_s", "waiting for inputs"))


def plot_node_breakdown(results: Mapping[str, Any], path: Path, max_nodes: int = 12) -> None:
    """Mean seconds per node spent in LLM calls vs tool stalls, bars per system (first point with data)."""
    plt = _plt()
    point = results["points"][0]
    systems = list(point["systems"])
    breakdown = {n: point["systems"][n]["client"]["node_breakdown_s"] for n in systems}
    totals: dict[str, float] = {}
    for table in breakdown.values():
        for node, parts in table.items():
            totals[node] = max(totals.get(node, 0.0), sum(parts.get(k, 0.0) for k, _ in _PARTS))
    nodes = sorted(totals, key=lambda n: -totals[n])[:max_nodes]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(nodes) * len(systems) + 2), 4.5))
    width = 0.8 / max(1, len(systems))
    colors = {"llm_s": "tab:blue", "tool_s": "tab:orange", "queue_s": "tab:gray"}
    hatches = ["", "//", "..", "xx", "\\\\", "oo"]
    parts = [
        (key, label)
        for key, label in _PARTS
        if any(breakdown[name].get(n, {}).get(key, 0.0) > 0.01 for name in systems for n in nodes)
    ]
    for si, name in enumerate(systems):
        bottom = [0.0] * len(nodes)
        xs = [i + si * width for i in range(len(nodes))]
        for key, label in parts:
            vals = [breakdown[name].get(n, {}).get(key, 0.0) for n in nodes]
            ax.bar(
                xs,
                vals,
                width,
                bottom=bottom,
                color=colors[key],
                hatch=hatches[si % len(hatches)],
                edgecolor="white",
                label=f"{label} · {name}",
            )
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(nodes))])
    ax.set_xticklabels(nodes, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("mean seconds per node")
    ax.set_title(f"per-node time: LLM vs tool stall ({point['label']})")
    top = max((totals[n] for n in nodes), default=1.0)
    ax.set_ylim(0, top * 1.45 if top > 0 else 1.0)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=len(systems), loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(results: Mapping[str, Any], path: Path) -> None:
    """Mean and p95 app E2E against the workload point (load sweeps only)."""
    plt = _plt()
    points = results["points"]
    labels = [p["label"] for p in points]
    systems = list(dict.fromkeys(n for p in points for n in p["systems"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in systems:
        for stat, style in (("mean", "-o"), ("p95", "--x")):
            ys = [lookup(p["systems"].get(name), "client", "e2e_s", stat) for p in points]
            ax.plot(labels, [y if y is not None else float("nan") for y in ys], style, label=f"{name} {stat}")
    ax.set_xlabel("workload point")
    ax.set_ylabel("app E2E latency (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
