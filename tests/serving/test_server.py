"""Server without vLLM: the process lifecycle, readiness, and the client calls on a running server.

Argv/env building and the preflight refusals are ``ServerConfig``'s (``test_server_config.py``).
The lifecycle tests swap vLLM for a tiny stand-in (an HTTP server answering /health and
/v1/models that also forks a SIGTERM-ignoring "EngineCore"), so they exercise the real watchdog,
readiness polling, early-exit detection and the no-orphan guarantees in a few seconds.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tokencake.serving import server as srvmod
from tokencake.serving.model import ModelError
from tokencake.serving.process_group import group_alive
from tokencake.serving.server import Server, ServerError


def test_stats_of_baseline_is_an_error() -> None:
    with pytest.raises(ServerError, match="baseline"):
        Server(baseline=True).stats()


# ---------------------------------------------------------------------------------------------
# Lifecycle with a stand-in for vLLM
# ---------------------------------------------------------------------------------------------

FAKE_VLLM = """
import argparse, http.server, json, os, signal, subprocess, sys, threading, time
p = argparse.ArgumentParser()
p.add_argument("--port", type=int)
p.add_argument("--host")
p.add_argument("--served-model-name")
p.add_argument("--kv-transfer-config")
a, _ = p.parse_known_args()
mode = os.environ.get("FAKE_MODE", "ok")
print("fake vllm starting", flush=True)
if mode == "crash":
    print("ValueError: Available memory on node 0 is too small", flush=True)
    sys.exit(3)
if mode == "log-crash":  # replay a real vLLM failure log
    sys.stdout.write(open(os.environ["FAKE_LOG"]).read()); sys.stdout.flush()
    sys.exit(1)
# A stubborn "EngineCore": ignores SIGTERM, so only the SIGKILL escalation removes it.
subprocess.Popen([sys.executable, "-c",
    "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"])
if mode == "hang":
    time.sleep(3600)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"{}" if self.path == "/health" else json.dumps(
            {"data": [{"id": a.served_model_name}]}).encode()
        if self.path == "/metrics":
            body = b"vllm:prompt_tokens_total{engine=\\"0\\"} 3.0\\n"
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args): pass
time.sleep(0.5)
if a.kv_transfer_config:  # the extension's events listener (EngineCore starts it before serving)
    extra = json.loads(a.kv_transfer_config)["kv_connector_extra_config"]
    if mode == "no-events":
        print("(EngineCore pid=1) ERROR 01-01 00:00:00 [connector.py:1] TokenCake events listener not "
              f"started ({extra['events_host']}:{extra['events_port']}): [Errno 98] Address already in use",
              flush=True)
    else:
        events = http.server.HTTPServer((extra["events_host"], extra["events_port"]), H)
        threading.Thread(target=events.serve_forever, daemon=True).start()
http.server.HTTPServer((a.host, a.port), H).serve_forever()
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    """A 'python' that runs the stand-in for ``-m vllm.entrypoints.openai.api_server``."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "vllm.entrypoints.openai.api_server" ]; then\n'
        f'  shift 2; exec "{sys.executable}" "{script}" "$@"\n'
        "fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tiny-model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def _fake_server(fake_python: str, model_dir: Path, tmp_path: Path, mode: str, **kw: object) -> Server:
    return Server(
        model_dir,
        python=fake_python,
        env={"FAKE_MODE": mode},
        log_file=tmp_path / f"{mode}.log",
        shutdown_timeout=1,
        kill_after=1.0,
        **kw,  # type: ignore[arg-type]
    )


def test_lifecycle_and_no_orphans(cpu: None, fake_python: str, model_dir: Path, tmp_path: Path) -> None:
    ticks: list[float] = []
    srv = _fake_server(fake_python, model_dir, tmp_path, "ok", progress=lambda t, _line: ticks.append(t))
    with srv:
        assert srv.running
        assert srv.model == "tiny-model"
        assert srv.startup_s is not None
        pgid = srv.pgid
        assert pgid is not None and group_alive(pgid)
        assert srv.metrics()["vllm:prompt_tokens_total"] == 3.0
        assert json.loads(json.dumps(srv.state()))["port"] == srv.port
    assert not srv.running
    assert not group_alive(pgid)  # the SIGTERM-ignoring grandchild was killed too
    assert ticks, "progress callback never called"
    srv.stop()  # idempotent


def test_early_exit_shows_the_cause(cpu: None, fake_python: str, model_dir: Path, tmp_path: Path) -> None:
    srv = _fake_server(fake_python, model_dir, tmp_path, "crash")
    with pytest.raises(ServerError, match=r"exited with code 3 .*ValueError: Available memory") as err:
        srv.start()
    assert "fake vllm starting" in err.value.log_tail
    assert not srv.running


def test_early_exit_names_the_kv_cause_and_fix(
    cpu: None, fake_python: str, model_dir: Path, tmp_path: Path, kv_log: tuple[str, str]
) -> None:
    log = tmp_path / "vllm-output.txt"
    log.write_text(kv_log[0] + "\n".join(f"(APIServer pid=4200) INFO shutdown line {i}" for i in range(40)))
    srv = _fake_server(fake_python, model_dir, tmp_path, "log-crash")
    srv.env["FAKE_LOG"] = str(log)
    with pytest.raises(ServerError) as err:
        srv.start()
    assert "max seq len (4096)" in str(err.value)  # > 30 lines before the end of the log
    assert "lower --max-model-len (about 2944 fits)" in str(err.value)
    assert not srv.running


def test_startup_timeout_stops_everything(
    cpu: None, fake_python: str, model_dir: Path, tmp_path: Path
) -> None:
    # 5 s: under a loaded CI machine the stand-in took over 2 s to print its first line.
    srv = _fake_server(fake_python, model_dir, tmp_path, "hang", startup_timeout=5.0)
    with pytest.raises(ServerError, match="did not become ready within 5 s"):
        srv.start()
    log = (tmp_path / "hang.log").read_text()
    assert "fake vllm starting" in log
    assert not srv.running


def test_a_missing_events_listener_fails_the_start_and_names_it(
    cpu: None, fake_python: str, model_dir: Path, tmp_path: Path
) -> None:
    """vLLM serving without its events listener (the connector could not bind it) is no TokenCake
    server: readiness says so instead of serving without events and stats."""
    srv = _fake_server(fake_python, model_dir, tmp_path, "no-events")
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"events listener .* did not start: .*Address already in use"):
        srv.start()
    assert time.monotonic() - t0 < 30
    assert not srv.running
    baseline = _fake_server(fake_python, model_dir, tmp_path, "no-events", baseline=True)
    with baseline:  # no extension, no listener expected
        assert baseline.running


def test_stop_from_another_thread_ends_a_start_at_once(
    cpu: None, fake_python: str, model_dir: Path, tmp_path: Path
) -> None:
    """A supervisor shutting down stops a replica that is still starting: ``start`` must give up
    then, not wait out its startup timeout."""
    import threading

    srv = _fake_server(fake_python, model_dir, tmp_path, "hang", startup_timeout=120.0)
    threading.Timer(1.5, srv.stop).start()
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="stopped while starting"):
        srv.start()
    assert time.monotonic() - t0 < 20
    assert not srv.running


def test_unknown_model_fails_before_launch(cpu: None, fake_python: str, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no such model directory"):
        Server(tmp_path / "nope", python=fake_python).start()


def test_owner_killed_by_sigkill_leaves_nothing(
    cpu: None, fake_python: str, model_dir: Path, tmp_path: Path
) -> None:
    """The watchdog notices its owner vanished (SIGKILL: no cleanup code runs) and stops vLLM."""
    owner = textwrap.dedent(
        f"""
        import sys, time
        from tokencake.serving import machine
        from tokencake.serving.server import Server
        machine.cuda_available = lambda: False
        machine.vllm_installed = lambda: True
        s = Server({str(model_dir)!r}, python={fake_python!r}, env={{"FAKE_MODE": "ok"}},
                   log_file={str(tmp_path / "owner.log")!r}, shutdown_timeout=1,
                   kill_after=1.0)
        s.start()
        print(s.pgid, flush=True)
        time.sleep(3600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pgid = int(proc.stdout.readline())
        assert group_alive(pgid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not group_alive(pgid), "vLLM stand-in survived its owner"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_public_names_of_the_module_resolve() -> None:
    """``from tokencake.serving.server import ...`` is public API: its names stay put."""
    assert sorted(srvmod.__all__) == [
        "CONNECTOR_CLASS",
        "CONNECTOR_MODULE",
        "ModelError",
        "SPATIAL_SCHEDULER",
        "Server",
        "ServerError",
        "find_free_port",
        "gpu_only_flags",
        "port_is_free",
        "startup_cause",
        "startup_error_message",
        "startup_hint",
        "stop_process_group",
    ]
    assert all(getattr(srvmod, name, None) is not None for name in srvmod.__all__)
