"""DAG analysis: validation and the per-node metadata every LLM request carries.

Everything here is a pure function of a ``networkx.DiGraph`` and node weights (predicted
seconds), computed once per app. The server uses the result to order requests: a node on the
critical path delays the whole app, a node with slack can wait.
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx

from tokencake.events import GraphMeta

#: Two path lengths closer than this are equal (weights are float sums of seconds).
EPS = 1e-9


def cycle_text(graph: nx.DiGraph) -> str | None:
    """One cycle of ``graph`` written ``a -> b -> a``, or None when it is acyclic."""
    try:
        edges = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return None
    nodes = [edges[0][0], *(dst for _, dst in edges)]
    return " -> ".join(map(str, nodes))


def _order(graph: nx.DiGraph) -> list[str]:
    # Deterministic topological order (ties by name) so results never depend on insertion order.
    return list(nx.lexicographical_topological_sort(graph, key=str))


def critical_path(graph: nx.DiGraph, weights: Mapping[str, float]) -> tuple[list[str], float]:
    """The longest path by summed node weight, and its length in seconds.

    Ties are broken by node name (the alphabetically first predecessor / end node wins), so the
    result is stable across runs and insertion orders.
    """
    order = _order(graph)
    if not order:
        return [], 0.0
    best: dict[str, float] = {}
    prev: dict[str, str | None] = {}
    for node in order:
        preds = sorted(graph.predecessors(node), key=str)
        base, choice = 0.0, None
        for p in preds:
            if choice is None or best[p] > base + EPS:
                base, choice = best[p], p
        best[node] = base + weights[node]
        prev[node] = choice
    end = None
    for node in sorted(order, key=str):
        if end is None or best[node] > best[end] + EPS:
            end = node
    assert end is not None
    path = [end]
    while (p := prev[path[-1]]) is not None:
        path.append(p)
    path.reverse()
    return path, best[end]


def graph_meta(graph: nx.DiGraph, weights: Mapping[str, float]) -> dict[str, GraphMeta]:
    """:class:`~tokencake.events.GraphMeta` for every node.

    * ``depth``: edges on the longest path from a source; ``remaining_depth``: to a sink.
    * ``fanout_width``: the widest fan-out the node opens or sits in (its own out-degree or the
      largest out-degree among its predecessors), at least 1.
    * ``join_group``: the join node (in-degree > 1) that the node's branch feeds, following
      single-successor chains; None when the node does not lead into a join.
    * ``slack_s``: critical-path length minus the longest weighted path through the node;
      ``on_critical_path`` means zero slack, so equal parallel branches are all critical.
    """
    order = _order(graph)
    depth: dict[str, int] = {}
    to_node: dict[str, float] = {}  # longest weighted path ending at node (inclusive)
    for node in order:
        preds = list(graph.predecessors(node))
        depth[node] = max((depth[p] + 1 for p in preds), default=0)
        to_node[node] = max((to_node[p] for p in preds), default=0.0) + weights[node]
    remaining: dict[str, int] = {}
    from_node: dict[str, float] = {}  # longest weighted path after node (exclusive)
    join_group: dict[str, str | None] = {}
    for node in reversed(order):
        succs = sorted(graph.successors(node), key=lambda s: (depth[s], str(s)))
        remaining[node] = max((remaining[s] + 1 for s in succs), default=0)
        from_node[node] = max((weights[s] + from_node[s] for s in succs), default=0.0)
        joins = [s for s in succs if graph.in_degree(s) > 1]
        if joins:
            join_group[node] = str(joins[0])
        elif len(succs) == 1:
            join_group[node] = join_group[succs[0]]
        else:
            join_group[node] = None
    total = max(to_node.values(), default=0.0)
    metas: dict[str, GraphMeta] = {}
    for node in order:
        slack = max(0.0, total - (to_node[node] + from_node[node]))
        if slack < 1e-6:
            slack = 0.0
        widths = [graph.out_degree(node), *(graph.out_degree(p) for p in graph.predecessors(node))]
        metas[node] = GraphMeta(
            depth=depth[node],
            remaining_depth=remaining[node],
            in_degree=graph.in_degree(node),
            out_degree=graph.out_degree(node),
            fanout_width=max(1, *widths),
            join_group=join_group[node],
            on_critical_path=slack == 0.0,
            slack_s=round(slack, 6),
            critical_path_s=round(total, 6),
        )
    return metas
