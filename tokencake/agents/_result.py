"""What a run produces: outputs, per-node timings, token usage and the event log."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from tokencake.events import StallBegin, StallEnd

from ._llm import Usage

if TYPE_CHECKING:
    import networkx as nx

EventKind = Literal[
    "run_started",
    "node_ready",
    "node_started",
    "llm_started",
    "llm_finished",
    "llm_failed",
    "tool_started",
    "tool_finished",
    "node_finished",
    "node_failed",
    "run_finished",
    # only app.stream() yields these (they are not in RunResult.events):
    "stall_begin",
    "stall_end",
    "run_result",
]

NodeStatus = Literal["pending", "ready", "running", "ok", "failed", "cancelled"]


@dataclass(frozen=True)
class RunEvent:
    """One state change of a run (``ts`` is unix time); ``node`` is None for run-level events.

    ``run_id`` tells the runs apart when one observer watches several at once.
    """

    kind: EventKind
    node: str | None
    ts: float
    data: dict[str, Any] = field(default_factory=dict)
    run_id: str = ""


@dataclass
class NodeResult:
    """One node's outcome and where its time went (seconds).

    ``queue_s``: ready → started (waiting for ``max_concurrency``); ``llm_s``: in LLM requests;
    ``tool_s``: inside tool functions; ``stall_s``: stall_begin → stall_end, i.e. tool time plus the
    time spent delivering the events.
    """

    name: str
    output: Any = None
    status: NodeStatus = "pending"
    ready: float | None = None
    started: float | None = None
    finished: float | None = None
    queue_s: float = 0.0
    llm_s: float = 0.0
    tool_s: float = 0.0
    stall_s: float = 0.0
    usage: Usage = field(default_factory=Usage)
    llm_calls: int = 0
    tool_calls: int = 0
    error: str | None = None

    @property
    def wall_s(self) -> float:
        if self.started is None or self.finished is None:
            return 0.0
        return self.finished - self.started

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["output"] = jsonable(self.output)
        data["usage"] = dataclasses.asdict(self.usage)
        data["wall_s"] = self.wall_s
        return data


@dataclass
class RunResult:
    """The result of ``app.run``.

    ``status`` is ``ok``, or for the partial result of a run that did not complete ``failed``,
    ``timeout`` or ``cancelled``: then :attr:`completed` and :attr:`unfinished` say what got done.
    ``graph`` is the run's DAG: the app's graph plus the nodes spawned by ``ctx.fan_out``.
    """

    run_id: str
    app: str
    nodes: dict[str, NodeResult]
    sinks: list[str]
    events: list[RunEvent] = field(default_factory=list)
    stall_events: list[StallBegin | StallEnd] = field(default_factory=list)
    started: float = 0.0
    finished: float = 0.0
    status: str = "ok"
    graph: nx.DiGraph | None = field(default=None, repr=False, compare=False)

    @property
    def completed(self) -> list[str]:
        """Nodes that finished with an output (status ``ok``), in run order."""
        return [name for name, node in self.nodes.items() if node.status == "ok"]

    @property
    def unfinished(self) -> list[str]:
        """Nodes that did not finish: failed, cancelled, or never started."""
        return [name for name, node in self.nodes.items() if node.status != "ok"]

    @property
    def outputs(self) -> dict[str, Any]:
        return {name: node.output for name, node in self.nodes.items() if node.status == "ok"}

    @property
    def output(self) -> Any:
        """The sink's output, or ``{sink: output}`` when the app has several sinks."""
        if len(self.sinks) == 1:
            return self.nodes[self.sinks[0]].output
        return {s: self.nodes[s].output for s in self.sinks}

    @property
    def usage(self) -> Usage:
        total = Usage()
        for node in self.nodes.values():
            total = total + node.usage
        return total

    @property
    def wall_s(self) -> float:
        return max(0.0, self.finished - self.started)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (outputs that are not JSON become their repr)."""
        return {
            "run_id": self.run_id,
            "app": self.app,
            "status": self.status,
            "started": self.started,
            "finished": self.finished,
            "wall_s": self.wall_s,
            "usage": dataclasses.asdict(self.usage),
            "output": jsonable(self.output),
            "nodes": {name: node.to_dict() for name, node in self.nodes.items()},
            "events": [
                {"kind": e.kind, "node": e.node, "ts": e.ts, "data": jsonable(e.data)} for e in self.events
            ],
            "stall_events": [e.model_dump(mode="json") for e in self.stall_events],
        }

    #: Columns of :meth:`timing_rows` (seconds, tokens and call counts per node).
    TIMING_COLUMNS = (
        "node",
        "status",
        "start",
        "wall",
        "queue",
        "llm",
        "tool",
        "stall",
        "tokens",
        "llm#",
        "tool#",
    )

    def timing_rows(self) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
        """Formatted cells per node (in :attr:`TIMING_COLUMNS` order) and the total row.

        One source for every rendering (``timings_table``, the CLI's rich table).
        """
        nodes = list(self.nodes.values())
        rows = []
        for node in nodes:
            start = node.started - self.started if node.started is not None else None
            rows.append(
                (
                    node.name,
                    node.status,
                    "-" if start is None else f"{start:.2f}",
                    f"{node.wall_s:.2f}",
                    f"{node.queue_s:.2f}",
                    f"{node.llm_s:.2f}",
                    f"{node.tool_s:.2f}",
                    f"{node.stall_s:.2f}",
                    str(node.usage.total_tokens),
                    str(node.llm_calls),
                    str(node.tool_calls),
                )
            )
        total = (
            "total",
            self.status,
            "",
            f"{self.wall_s:.2f}",
            f"{sum(n.queue_s for n in nodes):.2f}",
            f"{sum(n.llm_s for n in nodes):.2f}",
            f"{sum(n.tool_s for n in nodes):.2f}",
            f"{sum(n.stall_s for n in nodes):.2f}",
            str(self.usage.total_tokens),
            str(sum(n.llm_calls for n in nodes)),
            str(sum(n.tool_calls for n in nodes)),
        )
        return rows, total

    def timings_table(self) -> str:
        """A fixed-width table of per-node timings (seconds) and tokens, plus a total line."""
        header = self.TIMING_COLUMNS
        rows, total = self.timing_rows()
        table = [header, *rows, total]
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]

        def fmt(row: tuple[str, ...]) -> str:
            cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
            cells += [cell.rjust(w) for cell, w in zip(row[2:], widths[2:], strict=True)]
            return "  ".join(cells).rstrip()

        rule = "  ".join("-" * w for w in widths)
        return "\n".join([fmt(header), rule, *(fmt(r) for r in rows), rule, fmt(total)])


def jsonable(value: Any) -> Any:
    """``value`` if JSON can hold it, pydantic models / dataclasses as dicts, anything else as repr."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value
