"""``tokencake apps`` / ``run`` / ``graph``: output formats, JSON schema, non-terminal output, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import pytest

from tokencake.agents import catalog
from tokencake.cli import main

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


def test_device_blocks_needs_the_embedded_server(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = cli(["run", "rag", "--scripted", "--device-blocks", "40"], capsys)
    assert code == 2 and "use it with --serve" in err and len(err.strip().splitlines()) == 1


def test_compare_baseline_needs_the_embedded_server_and_no_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = cli(["run", "rag", "--scripted", "--compare-baseline"], capsys)
    assert code == 2 and "use it with --serve" in err and len(err.strip().splitlines()) == 1
    code, _out, err = cli(["run", "rag", "--serve", "--json", "--compare-baseline"], capsys)
    assert code == 2 and "not with --json" in err and len(err.strip().splitlines()) == 1
