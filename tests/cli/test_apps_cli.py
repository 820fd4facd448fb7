"""``tokencake apps`` / ``run`` / ``graph``: output formats, JSON schema, non-terminal output, errors."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import pytest
from rich.console import Console

import tokencake as tc
from tokencake.agents import catalog
from tokencake.cli import main
from tokencake.cli._apps import Progress

_TIMING = {"type": "number", "minimum": 0}
_TOKENS = {
    "type": "object",
    "required": ["prompt", "completion", "total"],
    "properties": {k: {"type": "integer", "minimum": 0} for k in ("prompt", "completion", "total")},
}
RUN_SCHEMA = {
    "type": "object",
    "required": [
        "version",
        "app",
        "run_id",
        "status",
        "error",
        "model",
        "latency",
        "inputs",
        "wall_s",
        "critical_path",
        "usage",
        "tool_calls",
        "llm_calls",
        "stall_events",
        "stall_pairs",
        "nodes",
        "outputs",
        "output",
        "answer",
    ],
    "properties": {
        "version": {"const": 1},
        "app": {"type": "string"},
        "run_id": {"type": "string", "minLength": 1},
        "status": {"enum": ["ok", "failed", "timeout", "cancelled"]},
        "error": {"type": ["string", "null"]},
        "model": {"type": ["string", "null"]},
        "latency": {"type": "string"},
        "inputs": {"type": "object", "additionalProperties": {"type": "string"}},
        "wall_s": _TIMING,
        "critical_path": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "usage": _TOKENS,
        "tool_calls": {"type": "integer", "minimum": 0},
        "llm_calls": {"type": "integer", "minimum": 0},
        "stall_events": {"type": "integer", "minimum": 0},
        "stall_pairs": {"type": "integer", "minimum": 0},
        "nodes": {
            "type": "object",
            "minProperties": 1,
            "additionalProperties": {
                "type": "object",
                "required": [
                    "status",
                    "queue_s",
                    "wall_s",
                    "llm_s",
                    "tool_s",
                    "stall_s",
                    "llm_calls",
                    "tool_calls",
                    "tokens",
                    "error",
                ],
                "properties": {
                    "status": {"enum": ["pending", "ready", "running", "ok", "failed", "cancelled"]},
                    "queue_s": _TIMING,
                    "wall_s": _TIMING,
                    "llm_s": _TIMING,
                    "tool_s": _TIMING,
                    "stall_s": _TIMING,
                    "llm_calls": {"type": "integer", "minimum": 0},
                    "tool_calls": {"type": "integer", "minimum": 0},
                    "tokens": _TOKENS,
                    "error": {"type": ["string", "null"]},
                },
            },
        },
        "outputs": {"type": "object"},
        "answer": {"type": ["string", "null"]},
    },
}
ANSI = "\x1b["


@pytest.fixture(autouse=True)
def _sandboxes_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", catalog.app_names())
def test_run_json_matches_the_schema(name: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = cli(
        ["run", name, "--scripted", "--json", "--latency", "scaled:0", "--workdir", str(tmp_path)], capsys
    )
    assert code == 0, err
    doc = json.loads(out)  # stdout holds exactly one JSON document
    jsonschema.validate(doc, RUN_SCHEMA)
    assert doc["app"] == name and doc["status"] == "ok" and doc["error"] is None
    assert doc["stall_pairs"] == doc["tool_calls"] > 0
    assert doc["stall_events"] == 2 * doc["tool_calls"]
    assert set(doc["nodes"]) == set(catalog.get_app(name).nodes)
    assert doc["usage"]["total"] == sum(n["tokens"]["total"] for n in doc["nodes"].values()) > 0
    assert doc["inputs"] == catalog.default_inputs(name)
    assert doc["answer"] and doc["output"] is not None
    assert ANSI not in out


def test_run_json_reports_a_failed_run(capsys: pytest.CaptureFixture[str]) -> None:
    # paper latency pads the two rag tools to 1.1 s in total, so a 0.2 s timeout always hits
    args = ["run", "rag", "--scripted", "--json", "--latency", "paper", "--timeout", "0.2"]
    code, out, _ = cli(args, capsys)
    doc = json.loads(out)
    jsonschema.validate(doc, RUN_SCHEMA)
    assert code == 1 and doc["status"] == "timeout" and "timed out after 0.2 s" in doc["error"]
    assert doc["nodes"]["rag"]["status"] == "cancelled"
    assert doc["output"] is None and doc["answer"] is None


def test_run_human_output_off_a_terminal_has_no_escape_codes(tmp_path: Path) -> None:
    # Even with colour forced on by the environment, a pipe gets plain text.
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100", "FORCE_COLOR": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tokencake", "run", "deep-research", "--scripted", "--latency", "scaled:0.01"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert ANSI not in proc.stdout and ANSI not in proc.stderr
    assert "LLM s" in proc.stdout and "tool s" in proc.stdout and "tokens" in proc.stdout
    assert "## References" in proc.stdout  # the final answer
    assert "writer" in proc.stderr and "done" in proc.stderr  # plain progress lines instead of a live view


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


def test_apps_lists_every_app(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(["apps"], capsys)
    assert code == 0 and ANSI not in out
    for info in catalog.list_apps():
        assert info.name in out and str(info.nodes) in out
    code, out, _ = cli(["apps", "--json"], capsys)
    assert [a["name"] for a in json.loads(out)] == catalog.app_names()


def test_unknown_app_lists_available_ones(capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["run", "nope", "--scripted"], ["graph", "nope"]):
        code, out, err = cli(command, capsys)
        assert code == 2 and out == ""
        assert "unknown app 'nope'" in err
        assert all(name in err for name in catalog.app_names())


def test_missing_or_unknown_inputs_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(["run", "rag", "--scripted", "--task", "  "], capsys)
    assert code == 2 and "missing required input 'task'" in err
    code, _, err = cli(["run", "rag", "--scripted", "--input", "question=hi"], capsys)
    assert code == 2 and "no input 'question'" in err and "inputs: task" in err
    code, _, err = cli(["run", "rag", "--scripted", "--input", "novalue"], capsys)
    assert code == 2 and "KEY=VALUE" in err
    code, _, err = cli(["run", "rag", "--scripted", "--latency", "warp"], capsys)
    assert code == 2 and "unknown latency" in err
    code, _, err = cli(["run", "deep-research", "--scripted", "--param", "branch=2"], capsys)
    assert code == 2 and "branches" in err


def test_run_uses_task_and_params(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(
        [
            "run",
            "deep-research",
            "--scripted",
            "--json",
            "--latency",
            "scaled:0",
            "--task",
            "How does paged attention work?",
            "--param",
            "branches=2",
        ],
        capsys,
    )
    doc = json.loads(out)
    assert code == 0 and doc["inputs"] == {"task": "How does paged attention work?"}
    assert sorted(n for n in doc["nodes"] if n.startswith("researcher_")) == ["researcher_1", "researcher_2"]


def test_graph_text_marks_the_critical_path(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(["graph", "code-writer"], capsys)
    assert code == 0
    assert "29 nodes, 36 edges" in out
    app = catalog.get_app("code-writer")
    starred = [line.split()[2] for line in out.splitlines() if line[4:5] == "*"]
    assert starred == app.critical_path
    assert out.strip().endswith(" → ".join(app.critical_path))


def test_graph_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "dag.png"
    code, out, _ = cli(["graph", "deep-research", "--png", str(png), "--param", "branches=4"], capsys)
    assert code == 0 and "wrote" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_kv_summary_says_what_the_extension_did() -> None:
    from tokencake.cli._apps import kv_summary

    counters = {
        "events.stall_begin": 10,
        "stalls.decision.offload": 3,
        "stalls.decision.already_on_host": 2,
        "stalls.decision.no_pressure": 5,
        "next_turn.requests": 8,
        "next_turn.prefix_tokens": 4096,
        "next_turn.prefix_tokens_device": 2048,
        "next_turn.prefix_tokens_host": 1536,
        "next_turn.prefix_tokens_recomputed": 512,
        "offload.bytes": 12_000_000,
        "offload.blocks": 12,
        "prefetch.bytes": 8_000_000,
        "prefetch.on_time": 2,
        "prefetch.late": 1,
        "demand_load.blocks": 4,
        "tokens.from_host": 1536,
    }
    text = "\n".join(kv_summary(counters))
    assert "tool calls (stalls): 10" in text and "offload 3" in text and "already on host 2" in text
    assert "4,096 tokens = device 2,048 + host 1,536 + recomputed 512" in text
    assert "offload 12.0 MB" in text and "on time 2, late 1" in text and "no KV pressure" not in text
    assert "time to first token" not in text  # no histogram given
    ttft = {"count": 8, "mean": 0.41, "p90": 0.9, "max": 1.2}
    text = "\n".join(kv_summary(counters, {"next_turn.ttft_s": ttft}))
    assert "time to first token: mean 0.41 s · p90 0.90 s · max 1.20 s (8 turns)" in text
    quiet = kv_summary({"events.stall_begin": 3, "stalls.decision.no_pressure": 3})
    assert any("no KV pressure" in line for line in quiet)
    assert "no tool calls" in kv_summary({})[0]


def test_device_blocks_needs_the_embedded_server(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = cli(["run", "rag", "--scripted", "--device-blocks", "40"], capsys)
    assert code == 2 and "use it with --serve" in err and len(err.strip().splitlines()) == 1


def test_compare_baseline_needs_the_embedded_server_and_no_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = cli(["run", "rag", "--scripted", "--compare-baseline"], capsys)
    assert code == 2 and "use it with --serve" in err and len(err.strip().splitlines()) == 1
    code, _out, err = cli(["run", "rag", "--serve", "--json", "--compare-baseline"], capsys)
    assert code == 2 and "not with --json" in err and len(err.strip().splitlines()) == 1


def test_resumed_turns_are_the_llm_calls_after_a_tool() -> None:
    from tokencake.cli._apps import resumed_turn_latencies, run_figures

    app = catalog.get_app("rag", latency="scaled:0")
    result = app.run_sync(llm=catalog.scripted_llm("rag"), **catalog.default_inputs("rag"))
    calls = [e for e in result.events if e.kind == "llm_finished"]
    tools = [e for e in result.events if e.kind == "tool_finished"]
    assert len(calls) >= 2 and tools
    resumed = resumed_turn_latencies(result)
    # rag is one agent: LLM → tools → LLM; every call that follows a tool call counts, once.
    assert 1 <= len(resumed) <= min(len(tools), len(calls) - 1)
    assert all(x >= 0 for x in resumed)
    metrics = {'vllm:prompt_tokens_by_source_total{source="local_compute"}': 900.0}
    figures = run_figures(result, metrics)
    assert figures["resumed"] == len(resumed) and figures["computed_prompt_tokens"] == 900.0
    assert figures["status"] == "ok" and figures["prompt_tokens"] is None


def test_compare_table_puts_both_systems_side_by_side() -> None:
    from tokencake.cli._apps import compare_table

    ext = {"status": "ok", "wall_s": 30.0, "llm_s": 20.0, "resumed": 4, "resumed_mean_s": 1.0}
    base = {"status": "ok", "wall_s": 40.0, "llm_s": 30.0, "resumed": 4, "resumed_mean_s": 2.0}
    ext["computed_prompt_tokens"], base["computed_prompt_tokens"] = 5000.0, 10000.0
    console = Console(file=io.StringIO(), width=140, force_terminal=False)
    console.print(compare_table(ext, base))
    text = console.file.getvalue()
    assert "30.00 s" in text and "40.00 s" in text and "0.75" in text  # wall time and its ratio
    assert "5,000" in text and "10,000" in text and "0.50" in text
    assert "—" in text  # prompt tokens / preemptions not given
