"""What the simulator replays: agent apps as DAGs of sessions, each a sequence of LLM calls and tools.

A trace says *what the agents do*, never how fast a server did it: per LLM call the prompt and
output tokens, per tool call the tool, its ``predict_time`` hint and how long it really took, per
node the nodes it waits for. The simulator decides when each call runs (a closed loop, like the
SDK's runner: a session's next call is sent when its tool returns), so one trace compares policies
and hardware fairly.

A session's conversation only grows: call *k* repeats call *k − 1*'s prompt and output and appends
new tokens. Sessions of a ``prefix_group`` open with the same ``prefix_tokens`` tokens (a shared
system prompt), so their first blocks are shared in the prefix cache.

JSONL on disk: a ``{"type": "trace", "version": 1, ...}`` header line, then one ``{"type": "app"}``
line per app. Steps are compact: ``{"llm": [prompt, output]}``, ``{"tool": [name, predicted_s,
actual_s]}``, ``{"delay": seconds}`` (agent-side time that is neither: a staggered start).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokencake.events import GraphMeta, priority_from_graph

if TYPE_CHECKING:
    from tokencake.agents import RunResult

__all__ = ["AppTrace", "DelayStep", "LLMStep", "NodeTrace", "Step", "ToolStep", "Trace", "TraceError"]

VERSION = 1


class TraceError(ValueError):
    """A trace file or object that cannot be simulated (the message says where)."""


@dataclass(frozen=True)
class LLMStep:
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class ToolStep:
    tool: str
    #: The tool's ``predict_time`` hint (what the SDK sends in ``stall_begin``); 0 = none.
    predicted_s: float
    actual_s: float


@dataclass(frozen=True)
class DelayStep:
    seconds: float


Step = LLMStep | ToolStep | DelayStep


@dataclass(frozen=True)
class NodeTrace:
    """One agent node: one session (one growing conversation) and the nodes it waits for."""

    name: str
    steps: tuple[Step, ...]
    agent_type: str = ""
    after: tuple[str, ...] = ()
    prefix_group: str | None = None
    prefix_tokens: int = 0
    #: vLLM ``priority`` of its requests (lower first), as the SDK sends it: 0 on the app's critical
    #: path, else the node's slack in whole seconds (``tokencake.events.priority_from_graph``).
    priority: int = 0

    @property
    def llm_calls(self) -> int:
        return sum(isinstance(s, LLMStep) for s in self.steps)


@dataclass(frozen=True)
class AppTrace:
    run_id: str
    arrival_s: float
    nodes: tuple[NodeTrace, ...]


@dataclass(frozen=True)
class Trace:
    apps: tuple[AppTrace, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate(self)

    # ------------------------------------------------------------------ summary
    @property
    def num_sessions(self) -> int:
        return sum(len(a.nodes) for a in self.apps)

    @property
    def num_llm_calls(self) -> int:
        return sum(n.llm_calls for a in self.apps for n in a.nodes)

    # ------------------------------------------------------------------ files
    def write_jsonl(self, path: str | Path) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8") as f:
            f.write(json.dumps({"type": "trace", "version": VERSION, **dict(self.meta)}) + "\n")
            for app in self.apps:
                f.write(json.dumps(_app_to_json(app)) + "\n")
        return out

    @classmethod
    def read_jsonl(cls, path: str | Path) -> Trace:
        meta: dict[str, Any] = {}
        apps = []
        with Path(path).open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    kind = obj.get("type")
                    if kind == "trace":
                        if obj.get("version") != VERSION:
                            raise TraceError(f"unsupported trace version {obj.get('version')!r}")
                        meta = {k: v for k, v in obj.items() if k not in ("type", "version")}
                    elif kind == "app":
                        apps.append(_app_from_json(obj))
                    else:
                        raise TraceError(f"unknown line type {kind!r}")
                except (TraceError, KeyError, TypeError, ValueError) as exc:
                    raise TraceError(f"{path}:{lineno}: {exc}") from None
        return cls(tuple(apps), meta)

    # ------------------------------------------------------------------ from a real run
    @classmethod
    def from_runs(cls, runs: Iterable[tuple[float, RunResult]], **meta: Any) -> Trace:
        """A trace of real SDK runs, each with its arrival second (``RunResult.events`` carry the
        prompt/output tokens of every LLM call and the hint and duration of every tool call)."""
        return cls(tuple(app_from_run(r, arrival_s=t) for t, r in runs), meta)


def app_from_run(result: RunResult, *, arrival_s: float = 0.0) -> AppTrace:
    """One :class:`AppTrace` from a finished run's event log (the DAG from ``result.graph``)."""
    by_node: dict[str, list[Any]] = {}
    for ev in result.events:
        if ev.node is not None:
            by_node.setdefault(ev.node, []).append(ev)
    graph = result.graph
    nodes = []
    for name in result.nodes:
        steps: list[Step] = []
        last = None  # when the node's previous step ended
        agent_type = ""
        pending_tool: dict[str, Any] | None = None
        for ev in sorted(by_node.get(name, []), key=lambda e: e.ts):
            if ev.kind == "node_started":
                last = ev.ts
            elif ev.kind == "llm_started":
                agent_type = agent_type or str(ev.data.get("agent_type") or "")
                if last is not None and ev.ts - last > 0.05:
                    steps.append(DelayStep(round(ev.ts - last, 4)))
            elif ev.kind == "llm_finished":
                steps.append(
                    LLMStep(
                        int(ev.data.get("prompt_tokens") or 0), int(ev.data.get("completion_tokens") or 0)
                    )
                )
                last = ev.ts
            elif ev.kind == "tool_started":
                pending_tool = {
                    "tool": str(ev.data.get("tool") or ""),
                    "predicted_s": ev.data.get("predicted_s"),
                }
            elif ev.kind == "tool_finished" and pending_tool is not None:
                predicted = pending_tool["predicted_s"]
                steps.append(
                    ToolStep(
                        pending_tool["tool"],
                        float(predicted) if predicted is not None else 0.0,
                        float(ev.data.get("duration_s") or 0.0),
                    )
                )
                pending_tool, last = None, ev.ts
        after = tuple(graph.predecessors(name)) if graph is not None and name in graph else ()
        nodes.append(
            NodeTrace(name, tuple(steps), agent_type or name, after, priority=_priority(graph, name))
        )
    return AppTrace(result.run_id, arrival_s, tuple(nodes))


def _priority(graph: Any, name: str) -> int:
    """The priority the SDK sent for ``name``: from the run's graph metadata (0 when unknown)."""
    if graph is None or name not in graph:
        return 0
    attrs = graph.nodes[name]
    meta = GraphMeta(
        on_critical_path=bool(attrs.get("on_critical_path", False)), slack_s=float(attrs.get("slack_s", 0.0))
    )
    return priority_from_graph(meta)


def with_priorities(app: AppTrace, llm_s_per_output_token: float = 0.02) -> AppTrace:
    """``app`` with each node's priority computed as the SDK does: node weight = its LLM time
    (output tokens of its first call × 0.02 s, the SDK's default) + the hints of its tools; the
    critical path is the longest weighted path; a node off it gets its slack in whole seconds."""
    weight = {}
    for n in app.nodes:
        calls = [s for s in n.steps if isinstance(s, LLMStep)]
        tools = sum(s.predicted_s for s in n.steps if isinstance(s, ToolStep))
        weight[n.name] = (calls[0].output_tokens * llm_s_per_output_token if calls else 0.0) + tools
    nodes = {n.name: n for n in app.nodes}
    order: list[str] = []
    done: set[str] = set()
    while len(order) < len(nodes):
        for n in app.nodes:
            if n.name not in done and set(n.after) <= done:
                order.append(n.name)
                done.add(n.name)
    down: dict[str, float] = {}  # longest path from the node to a sink, inclusive
    for name in reversed(order):
        succ = [m for m in order if name in nodes[m].after]
        down[name] = weight[name] + max((down[m] for m in succ), default=0.0)
    up: dict[str, float] = {}  # longest path from a source to the node, inclusive
    for name in order:
        up[name] = weight[name] + max((up[d] for d in nodes[name].after), default=0.0)
    critical = max(down.values(), default=0.0)
    out = []
    for n in app.nodes:
        slack = critical - (up[n.name] + down[n.name] - weight[n.name])
        meta = GraphMeta(on_critical_path=slack <= 1e-9, slack_s=max(slack, 0.0))
        out.append(dataclasses.replace(n, priority=priority_from_graph(meta)))
    return dataclasses.replace(app, nodes=tuple(out))


# ---------------------------------------------------------------------- validation / JSON
def validate(trace: Trace) -> None:
    """Raise :class:`TraceError` for anything the simulator cannot replay."""
    seen_runs: set[str] = set()
    for app in trace.apps:
        if app.run_id in seen_runs:
            raise TraceError(f"duplicate run_id {app.run_id!r}")
        seen_runs.add(app.run_id)
        if not (math.isfinite(app.arrival_s) and app.arrival_s >= 0):
            raise TraceError(f"{app.run_id}: arrival_s must be a finite number >= 0")
        names = [n.name for n in app.nodes]
        if len(set(names)) != len(names):
            raise TraceError(f"{app.run_id}: duplicate node names")
        for node in app.nodes:
            where = f"{app.run_id}/{node.name}"
            missing = [d for d in node.after if d not in names]
            if missing:
                raise TraceError(f"{where}: waits for unknown node(s) {missing}")
            if node.prefix_tokens < 0:
                raise TraceError(f"{where}: prefix_tokens must be >= 0")
            prev = 0
            for step in node.steps:
                if isinstance(step, LLMStep):
                    if step.prompt_tokens < 1 or step.output_tokens < 1:
                        raise TraceError(f"{where}: an LLM call needs prompt and output tokens >= 1")
                    if step.prompt_tokens < prev:
                        raise TraceError(
                            f"{where}: a conversation only grows (prompt {step.prompt_tokens} < {prev})"
                        )
                    prev = step.prompt_tokens + step.output_tokens
                elif isinstance(step, ToolStep):
                    if not (step.actual_s >= 0 and math.isfinite(step.actual_s)):
                        raise TraceError(f"{where}: tool {step.tool!r} needs a finite actual_s >= 0")
                elif not (step.seconds >= 0 and math.isfinite(step.seconds)):
                    raise TraceError(f"{where}: a delay must be a finite number of seconds >= 0")
        _check_acyclic(app)


def _check_acyclic(app: AppTrace) -> None:
    deps = {n.name: set(n.after) for n in app.nodes}
    done: set[str] = set()
    while deps:
        ready = [n for n, d in deps.items() if d <= done]
        if not ready:
            raise TraceError(f"{app.run_id}: the nodes' dependencies form a cycle")
        for n in ready:
            done.add(n)
            del deps[n]


def _step_to_json(step: Step) -> dict[str, Any]:
    if isinstance(step, LLMStep):
        return {"llm": [step.prompt_tokens, step.output_tokens]}
    if isinstance(step, ToolStep):
        return {"tool": [step.tool, step.predicted_s, step.actual_s]}
    return {"delay": step.seconds}


def _step_from_json(obj: Mapping[str, Any]) -> Step:
    if "llm" in obj:
        prompt, output = obj["llm"]
        return LLMStep(int(prompt), int(output))
    if "tool" in obj:
        tool, predicted, actual = obj["tool"]
        return ToolStep(str(tool), float(predicted), float(actual))
    if "delay" in obj:
        return DelayStep(float(obj["delay"]))
    raise TraceError(f"unknown step {obj!r}")


def _app_to_json(app: AppTrace) -> dict[str, Any]:
    return {
        "type": "app",
        "run_id": app.run_id,
        "arrival_s": app.arrival_s,
        "nodes": [
            {
                "name": n.name,
                "agent_type": n.agent_type,
                "after": list(n.after),
                **(
                    {"prefix_group": n.prefix_group, "prefix_tokens": n.prefix_tokens}
                    if n.prefix_group
                    else {}
                ),
                **({"priority": n.priority} if n.priority else {}),
                "steps": [_step_to_json(s) for s in n.steps],
            }
            for n in app.nodes
        ],
    }


def _app_from_json(obj: Mapping[str, Any]) -> AppTrace:
    nodes = tuple(
        NodeTrace(
            str(n["name"]),
            tuple(_step_from_json(s) for s in n["steps"]),
            str(n.get("agent_type") or ""),
            tuple(str(a) for a in n.get("after", ())),
            n.get("prefix_group"),
            int(n.get("prefix_tokens") or 0),
            int(n.get("priority") or 0),
        )
        for n in obj["nodes"]
    )
    return AppTrace(str(obj["run_id"]), float(obj["arrival_s"]), nodes)
