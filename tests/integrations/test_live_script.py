"""benchmarks/integrations_live.py (the adapters against a real server) runs its examples offline on
the scripted model, and flags server counters that do not match what the adapters sent."""

import importlib.util
import sys
from pathlib import Path

import pytest

import tokencake as tc

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "integrations_live.py"


@pytest.fixture(scope="module")
def live():
    spec = importlib.util.spec_from_file_location("integrations_live", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _tool_only_when_forced(req: tc.ScriptedRequest):
    # a model too small to call tools by itself: it calls one only when tool_choice requires it
    if req.body.get("tool_choice") == "required":
        return tc.ToolCall(f"c{req.index}", "lookup_order", {"order_id": "42"})
    return f"reply {req.index}"


@pytest.mark.parametrize("adapter", ["openai_agents", "langgraph", "pydantic_ai"])
def test_each_example_runs_offline_with_forced_tools(live, wire, adapter, capsys):
    pytest.importorskip(live.ADAPTERS[adapter][0])
    llm = tc.ScriptedLLM(_tool_only_when_forced)
    cfg = live.Config("http://tokencake.test/v1", "m", None, False, 0.01, force_tool=True)
    report = live.asyncio.run(live.run_adapter(adapter, cfg, wire(llm), with_stats=False))
    live.print_report(report)
    assert report.problems() == [], capsys.readouterr().out
    assert [b.get("tool_choice") for b in llm.requests] == ["required", "none"] * 2
    assert len({r["session_id"] for r in report.requests}) == 1 and len(report.requests) == 4
    assert [(b.tool, e.outcome) for b, e in report.pairs] == [("lookup_order", "ok")] * 2


def test_problems_compare_the_server_counters_with_what_was_sent(live):
    report = live.Report("x", requests=[{"session_id": "s", "turn": 0, "priority": 0}] * 2)
    begin = type("Begin", (), {"stall_id": "1"})()
    report.pairs = [(begin, object())]
    report.before = {"events.stall_begin": 5, "events.stall_end": 5, "requests.with_meta": 10}
    report.after = {"events.stall_begin": 6, "events.stall_end": 6, "requests.with_meta": 12}
    assert report.problems() == []
    report.after = {"events.stall_begin": 6, "events.stall_end": 5, "requests.with_meta": 10}
    assert report.problems() == [
        "server events.stall_end +0, the adapter sent 1",
        "server requests.with_meta +0, the adapter sent 2",
    ]
    report.requests.append({"session_id": None, "turn": None, "priority": None})
    report.pairs = []
    report.after = None
    assert report.problems() == [
        "1 of 3 chat requests had no session",
        "no tool call, so no stall (try --force-tool)",
    ]
