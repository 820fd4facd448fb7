"""``tokencake run``'s live view: every state a node passes through, folded from run events."""

from __future__ import annotations

import io
import time

from rich.console import Console

import tokencake as tc
from tokencake.agents import catalog
from tokencake.cli._run_view import Progress


def test_live_view_renders_every_state() -> None:
    app = catalog.get_app("rag")
    progress = Progress.for_app(app)
    now = time.time()

    def ev(kind: str, node: str | None = "rag", **data: object) -> tc.RunEvent:
        return tc.RunEvent(kind, node, now, data)  # type: ignore[arg-type]

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    states = []
    for event in [
        ev("run_started", None),
        ev("node_ready"),
        ev("node_started"),
        ev("llm_started", turn=0),
        ev("llm_finished", latency_s=0.5, prompt_tokens=10, completion_tokens=5),
        ev("tool_started", tool="embed_text"),
        ev("tool_finished", tool="embed_text", duration_s=0.25, outcome="ok"),
        ev("node_failed", error="boom [x]", cancelled=False),
    ]:
        progress(event)
        states.append(progress.nodes["rag"].state)
        console.print(progress)
    assert states == [
        "waiting",
        "ready",
        "running",
        "in LLM",
        "running",
        "in tool (stalled)",
        "running",
        "failed",
    ]
    view = progress.nodes["rag"]
    assert (view.llm_s, view.tool_s, view.tokens) == (0.5, 0.25, 15)
    assert "in tool (stalled)" in buf.getvalue() and "boom [x]" in buf.getvalue()
    progress(ev("node_finished", node="unknown-node"))  # events of other nodes are ignored
