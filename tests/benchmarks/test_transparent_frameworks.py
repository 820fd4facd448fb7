"""``benchmarks/transparent_frameworks.py``: its acceptance checks flag each way a run can miss, the
access log is read from an offset, frameworks not installed are skipped, and the stored results
pass the same checks they were written with."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
_PATH = ROOT / "benchmarks" / "transparent_frameworks.py"
_spec = importlib.util.spec_from_file_location("transparent_frameworks", _PATH)
assert _spec is not None and _spec.loader is not None
tf = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tf  # dataclasses look their module up
_spec.loader.exec_module(tf)

STORED = ROOT / "docs" / "bench" / "transparent-frameworks.json"


def _good(**delta: float) -> Any:
    counts = {
        "events.transparent_begin": 3,
        "events.transparent_end": 3,
        "next_turn.requests": 3,
        "next_turn.prefix_tokens": 768,
        "next_turn.prefix_tokens_device": 768,
    }
    return tf.AgentRun("plain_openai", returncode=0, tool_calls=3, chat_requests=6, delta={**counts, **delta})


def test_a_run_that_meets_the_acceptance_passes() -> None:
    run = _good()
    tf.check(run, transparent=True)
    assert (run.status, run.problems) == ("ok", [])


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"delta": {"events.transparent_begin": 2}}, "transparent begins +2, the agent made 3 tool calls"),
        ({"delta": {"events.transparent_end": 2}}, "transparent ends +2 != begins +3"),
        ({"delta": {"events.inferred_end": 1}}, "inferred ends +1"),
        ({"delta": {"next_turn.requests": 2}}, "next turns +2 != begins +3"),
        (
            {"delta": {"next_turn.prefix_tokens_recomputed": 128, "next_turn.recomputed_why.on_host": 1}},
            "next-turn prefix recomputed 128 tokens ({'next_turn.recomputed_why.on_host': 1})",
        ),
        ({"http_errors": ["400"]}, "HTTP errors: 400"),
        ({"chat_requests": None}, "no chat request in the API server's access log"),
        ({"returncode": 1}, "exit status 1"),
        ({"tokencake_modules": ["tokencake"]}, "the agent loaded tokencake modules: tokencake"),
        ({"tool_calls": 0}, "the agent made no tool call"),
    ],
)
def test_each_miss_is_named(change: dict[str, Any], problem: str) -> None:
    run = _good(**change.pop("delta", {}))
    for key, value in change.items():
        setattr(run, key, value)
    tf.check(run, transparent=True)
    assert run.status == "failed" and problem in run.problems


def test_with_transparent_mode_off_a_derived_stall_fails() -> None:
    run = tf.AgentRun("plain_openai", returncode=0, tool_calls=3, chat_requests=6)
    tf.check(run, transparent=False)
    assert run.status == "ok"
    run = tf.AgentRun("plain_openai", returncode=0, tool_calls=3, chat_requests=6)
    run.delta = {"events.transparent_begin": 1}
    tf.check(run, transparent=False)
    assert run.problems == ["transparent mode off, yet 1 begins / 0 ends"]


def test_the_access_log_is_read_from_an_offset(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    before = 'INFO:     127.0.0.1:40994 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error\n'
    log.write_text(
        before
        + "(APIServer pid=1) INFO 12-06 03:07:29 [api_utils.py:286] unrelated\n"
        + 'INFO:     127.0.0.1:40994 - "POST /v1/chat/completions HTTP/1.1" 200 OK\n'
        + 'INFO:     127.0.0.1:40994 - "GET /v1/models HTTP/1.1" 200 OK\n'
        + 'INFO:     127.0.0.1:40995 - "POST /v1/chat/completions HTTP/1.1" 400 Bad Request\n'
    )
    assert tf.access_log(log, 0) == ["500", "200", "400"]
    assert tf.access_log(log, len(before)) == ["200", "400"]
    assert tf.access_log(tmp_path / "missing.log", 0) == []


def test_a_framework_not_installed_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(tf.AGENTS, "plain_openai", ("tokencake_no_such_module", "nothing"))
    run = tf.run_agent("plain_openai", server=None, timeout=1, workdir=Path("."))  # type: ignore[arg-type]
    tf.check(run, transparent=True)
    assert run.status == "skipped"
    assert run.problems == ["skipped: tokencake_no_such_module is not installed (pip install nothing)"]


def test_the_stored_results_pass_their_checks() -> None:
    results = json.loads(STORED.read_text())
    names = {f.name for f in fields(tf.AgentRun)} - {"status", "problems"}
    for label, block in results["modes"].items():
        assert set(block["agents"]) == set(tf.AGENTS)
        for stored in block["agents"].values():
            run = tf.AgentRun(**{k: v for k, v in stored.items() if k in names})
            tf.check(run, transparent=label == "transparent")
            assert (run.status, run.problems) == (stored["status"], stored["problems"]) == ("ok", [])
            assert all(stored["delta"].get(key) is not None for key in tf.COUNTERS)
    lines = tf.table(results).splitlines()
    assert len(lines) == 2 + 2 * len(tf.AGENTS) and lines[0].startswith("agent")
