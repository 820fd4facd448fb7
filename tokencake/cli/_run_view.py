"""``tokencake run``'s live view: a run's ``observer`` events folded into per-node states.

Drawn by rich on a terminal; given a ``lines`` file instead, it prints one plain line per finished
or failed node.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

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


__all__ = ["Progress"]
