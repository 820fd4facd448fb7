"""``tokencake graph APP``: an app's DAG as text, or as a PNG picture, with its critical path."""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from tokencake.cli._apps_common import build_app, cli_error, param_value, parse_pairs


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
        raise cli_error("--png needs matplotlib (pip install 'tokencake[plot]')") from None
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
    params = {k: param_value(v) for k, v in parse_pairs(args.param, "--param").items()}
    app = build_app(args.app, params)
    if args.png:
        draw_png(app, args.png)
        nodes = app.graph.number_of_nodes()
        print(f"wrote {args.png} ({nodes} nodes, critical path: {' → '.join(app.critical_path)})")
        return 0
    print(graph_text(app))
    return 0


__all__ = ["cmd_graph", "draw_png", "graph_text"]
