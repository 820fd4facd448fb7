"""An app's DAG: built from the declaration and validated as a whole, with the predicted weights,
critical path and per-node metadata its LLM requests carry. Computed once per declaration."""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from tokencake.events import GraphMeta

from ._app_declare import AppDeclarations
from ._errors import AppDefinitionError
from ._graph import critical_path, cycle_text, graph_meta
from ._node import Node, Ref, fn_name

#: Predicted decode time per output token when an agent gives no ``predict_llm_s``.
SECONDS_PER_TOKEN = 0.02
#: Output tokens assumed for an agent without ``max_tokens`` (for the prediction only).
ASSUMED_MAX_TOKENS = 256


@dataclass(frozen=True)
class _Analysis:
    graph: nx.DiGraph
    metas: dict[str, GraphMeta]
    weights: dict[str, float]
    critical_path: list[str]
    critical_path_s: float
    calls: dict[str, list[str]]
    tools: dict[str, list[str]]


class AppGraph(AppDeclarations):
    """The validated graph of the declaration and what is predicted from it."""

    _analysis_cache: _Analysis | None

    def _changed(self) -> None:
        self._analysis_cache = None

    def validate(self) -> None:
        """Check the whole declaration; raises :class:`AppDefinitionError` listing every problem."""
        self._analysis()

    def _analysis(self) -> _Analysis:
        if self._analysis_cache is not None:
            return self._analysis_cache
        problems: list[str] = []
        if not self.nodes:
            problems.append(f"app {self.name!r} has no nodes")
        graph = nx.DiGraph()
        calls: dict[str, list[str]] = {}
        tools: dict[str, list[str]] = {}
        for node in self.nodes.values():
            graph.add_node(node.name)
        for node in self.nodes.values():
            for ref in node.after:
                try:
                    dep = self._node_ref(ref, f"{node.kind} {node.name!r} depends on")
                except AppDefinitionError as exc:
                    problems.extend(exc.problems)
                    continue
                if dep in self.nodes:
                    graph.add_edge(dep, node.name)
                elif dep in self.templates:
                    problems.append(
                        f"{node.kind} {node.name!r} depends on {dep!r}, a template (run it with ctx.fan_out)"
                    )
                elif dep in self.tools:
                    problems.append(f"{node.kind} {node.name!r} depends on {dep!r}, a tool, not a node")
                else:
                    problems.append(f"{node.kind} {node.name!r} depends on unknown node {dep!r}")
        for node in [*self.nodes.values(), *self.templates.values()]:
            for attr, out in (("calls", calls), ("tools", tools)):
                names = []
                for ref in getattr(node, attr):
                    tool = self._tool_ref(ref)
                    if tool is None or tool not in self.tools:
                        shown = tool or fn_name(ref)
                        problems.append(f"{node.kind} {node.name!r} lists unknown tool {shown!r} in {attr}=")
                    else:
                        names.append(tool)
                out[node.name] = names
        cycle = cycle_text(graph)
        if cycle:
            problems.append(f"cycle: {cycle}")
        if problems:
            raise AppDefinitionError(problems)
        every = {**self.nodes, **self.templates}
        weights = {name: self._weight(node, calls[name]) for name, node in every.items()}
        path, length = critical_path(graph, weights)
        metas = graph_meta(graph, weights)
        for name, node in self.nodes.items():
            graph.nodes[name].update(
                kind=node.kind,
                fn=node.fn,
                options=node.options(),
                calls=calls[name],
                tools=tools[name],
                weight_s=weights[name],
                meta=metas[name],
                **metas[name].model_dump(),
            )
        self._analysis_cache = _Analysis(graph, metas, weights, path, length, calls, tools)
        return self._analysis_cache

    def _weight(self, node: Node, calls: list[str]) -> float:
        tool_s = sum(self.tools[c].predicted_s or 0.0 for c in calls)
        if node.kind == "function":
            return (node.predict_s or 0.0) + tool_s
        if node.predict_llm_s is not None:
            return node.predict_llm_s + tool_s
        return (node.max_tokens or ASSUMED_MAX_TOKENS) * SECONDS_PER_TOKEN + tool_s

    @property
    def graph(self) -> nx.DiGraph:
        """The validated DAG; node attributes: kind, fn, options, calls, tools, weight_s, meta and
        the :class:`~tokencake.events.GraphMeta` fields. Do not mutate it: use ``link``/``add_*``."""
        return self._analysis().graph

    def meta(self, node: Ref) -> GraphMeta:
        """The graph metadata of ``node`` (sent with each of its LLM requests)."""
        name = self._node_ref(node, "meta")
        metas = self._analysis().metas
        if name not in metas:
            raise KeyError(f"{name!r} is not a node of app {self.name!r}")
        return metas[name]

    def weight(self, node: Ref) -> float:
        """Predicted seconds of ``node``: LLM time (``predict_llm_s`` or ``max_tokens`` x 0.02 s)
        plus the ``predict_time`` of the tools in its ``calls``."""
        return self._analysis().weights[self._node_ref(node, "weight")]

    @property
    def critical_path(self) -> list[str]:
        """The longest path by predicted seconds (ties broken by node name)."""
        return list(self._analysis().critical_path)

    @property
    def critical_path_s(self) -> float:
        return self._analysis().critical_path_s

    @property
    def sinks(self) -> list[str]:
        graph = self.graph
        return [n for n in self.nodes if graph.out_degree(n) == 0]
