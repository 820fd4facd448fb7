"""``Replicas`` / ``tokencake serve --replicas``: what gets started, and that it stays running.

The supervision tests run the real vllm-router and supervisor over stand-in replicas (small HTTP
worker processes, no vLLM): a replica killed with SIGKILL is restarted on its port while the
router keeps serving its sessions, and the status listener says so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokencake.cli import CLIError, build_parser
from tokencake.cli import _serve as serve_cli
from tokencake.events import SESSION_HEADER
from tokencake.serving.machine import find_free_port
from tokencake.serving.replicas import ROUTER_POLICIES, Replicas, RestartPolicy, router_available

KEY = "replicas-test-key-91c2"

WORKER = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, key = int(sys.argv[1]), os.environ.get("KEY")
class W(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _send(self, obj, status=200):
        b = json.dumps(obj).encode()
        self.send_response(status); self.send_header("content-length", str(len(b))); self.end_headers()
        self.wfile.write(b)
    def _keyed(self):
        if key and self.path.startswith("/v1") and self.headers.get("Authorization") != "Bearer " + key:
            self._send({"error": "Unauthorized"}, 401); return False
        return True
    def do_GET(self):
        if self._keyed():
            model = {"id": "m", "object": "model", "created": 0, "owned_by": "t"}
            self._send({"object": "list", "data": [model]})
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if self._keyed():
            msg = {"role": "assistant", "content": str(port)}
            self._send({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                        "choices": [{"index": 0, "finish_reason": "stop", "message": msg}]})
print("worker up", flush=True)
ThreadingHTTPServer(("127.0.0.1", port), W).serve_forever()
"""


class FakeServer:
    """What ``Replicas`` needs of a ``Server``, backed by a stand-in worker process."""

    host = "127.0.0.1"
    model = "m"
    events_url = None

    def __init__(self, port: int, log_path: Path, api_key: str | None, script: Path) -> None:
        self.port, self.log_path, self.api_key, self.script = port, log_path, api_key, script
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def start(self) -> FakeServer:
        self.port = self.port or find_free_port(with_events=False)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "KEY": self.api_key or ""}
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, str(self.script), str(self.port)], stdout=log, stderr=log, env=env
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("stand-in worker did not start")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def stats(self) -> dict[str, Any]:
        return {}


@pytest.fixture
def fake_servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)

    def make(self: Replicas, i: int, port: int = 0) -> FakeServer:
        return FakeServer(port, self.log_dir / f"replica-{i}.log", self.api_key, script)

    monkeypatch.setattr(Replicas, "_server", make)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="replicas"):
        Replicas(0)
    with pytest.raises(ValueError, match="router policy"):
        Replicas(2, router_policy="fastest")
    with pytest.raises(ValueError, match="per replica"):
        Replicas(2, port=8000, events_port=8001)
    assert "consistent_hash" in ROUTER_POLICIES and "round_robin" in ROUTER_POLICIES


def test_the_router_gets_every_replica_the_policy_and_the_key_for_its_probe() -> None:
    reps = Replicas(2, port=9000, router_policy="round_robin", num_gpu_blocks=40, api_key=KEY)
    reps.servers = [type("S", (), {"url": f"http://127.0.0.1:{p}"})() for p in (9101, 9103)]  # type: ignore[misc]
    router = reps.make_router()
    cmd = router.command()
    at = cmd.index("--worker-urls")
    assert cmd[at + 1 : at + 3] == ["http://127.0.0.1:9101", "http://127.0.0.1:9103"]
    assert cmd[cmd.index("--policy") + 1] == "round_robin" and cmd[cmd.index("--port") + 1] == "9000"
    assert router.api_key == KEY and KEY not in " ".join(cmd)
    assert reps.base_url == "http://127.0.0.1:9000/v1" and reps.status_url == "http://127.0.0.1:9001"
    assert reps.server_kwargs == {"num_gpu_blocks": 40, "api_key": KEY}


def test_replicas_get_their_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    two = Replicas(2)
    assert two._cores(0) == {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert two._cores(1)["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert Replicas(3)._cores(0) == {}  # fewer cores than replicas: leave vLLM's own layout
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert Replicas(2)._cores(1) == {"VLLM_CPU_OMP_THREADS_BIND": "4-7"}


def test_serve_replicas_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tokencake.serving.machine.cuda_available", lambda: False)
    args = build_parser().parse_args(["serve", "--replicas", "2", "--num-gpu-blocks", "40", "--spatial"])
    reps = serve_cli.build_replicas(args)
    assert reps.n == 2 and reps.router_policy == "consistent_hash"
    assert reps.server_kwargs["num_gpu_blocks"] == 40 and reps.server_kwargs["scheduler_cls"]
    for extra in (["--detach"], ["--events-port", "9001"], ["--log-file", "x.log"]):
        with pytest.raises(CLIError, match="not with --replicas"):
            serve_cli.build_replicas(build_parser().parse_args(["serve", "--replicas", "2", *extra]))


def test_the_router_is_installed_with_the_dev_extra() -> None:
    assert router_available()


def _ask(client: httpx.Client, url: str, sid: str) -> tuple[int, str]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    r = client.post(url + "/chat/completions", json=body, headers={SESSION_HEADER: sid})
    return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text


def _wait(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.usefixtures("fake_servers")
def test_a_killed_replica_is_restarted_while_the_router_keeps_its_sessions_served(tmp_path: Path) -> None:
    policy = RestartPolicy(backoff_s=0.5, max_backoff_s=1.0)
    with Replicas(2, log_dir=tmp_path, api_key=KEY, restart_policy=policy) as reps:
        sessions = [f"app:s{i}" for i in range(12)]
        with httpx.Client(timeout=20, headers={"Authorization": f"Bearer {KEY}"}) as client:
            home = {sid: _ask(client, reps.base_url, sid)[1] for sid in sessions}
            victim = reps.servers[1]
            port, pid = victim.port, victim.pid
            assert str(port) in home.values()  # some sessions live on the victim
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            # During the outage every session is served (the router retries on the live replica).
            during = {sid: _ask(client, reps.base_url, sid) for sid in sessions}
            assert all(code == 200 for code, _ in during.values()), during
            assert _wait(lambda: reps.status()["replicas"][1]["restarts"] == 1, 20), reps.status()
            assert reps.servers[1].port == port and reps.servers[1].pid != pid  # same worker URL
            # The restarted replica gets its sessions back once the router's checks pass.
            assert _wait(lambda: all(_ask(client, reps.base_url, s)[1] == home[s] for s in sessions), 30)
        status = httpx.get(reps.status_url + "/v1/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert [r["restarts"] for r in status["replicas"]] == [0, 1]
        assert status["replicas"][1]["last_exit"] == -signal.SIGKILL and status["replicas_up"] == 2
        assert status["router"]["up"] and status["failure"] is None
        assert KEY not in json.dumps(status)
        assert httpx.get(reps.status_url + "/v1/stats").status_code == 401
        assert httpx.get(reps.status_url + "/health").json() == {"ok": True, "events": False}
        assert (tmp_path / "replica-1.log.1").exists()  # the dead replica's log was kept
    assert all(not s.running for s in reps.servers) and not reps.router.running  # type: ignore[union-attr]


@pytest.mark.usefixtures("fake_servers")
def test_a_router_that_keeps_dying_stops_the_deployment(tmp_path: Path) -> None:
    policy = RestartPolicy(max_restarts=1, backoff_s=0.0)
    with Replicas(2, log_dir=tmp_path, restart_policy=policy) as reps:
        assert reps.router is not None and reps.router.pid is not None
        os.killpg(reps.router.pid, signal.SIGKILL)
        assert _wait(lambda: reps.status()["router"]["restarts"] == 1, 30)
        assert httpx.get(reps.base_url + "/models", timeout=5).status_code == 200
        assert reps.router.pid is not None
        os.killpg(reps.router.pid, signal.SIGKILL)  # the second death within the window
        assert _wait(lambda: reps.failure is not None, 10)
        assert reps.failure is not None and reps.failure.startswith("router could not be kept running")


def test_serve_stops_everything_when_the_supervisor_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    class Deployment:
        base_url = "http://127.0.0.1:1/v1"
        failure: str | None = None
        stopped = 0

        def start(self) -> None:
            self.failure = "router could not be kept running (exit 1)"

        def describe(self) -> list[str]:
            return []

        def stop(self) -> None:
            self.stopped += 1

    deployment = Deployment()
    monkeypatch.setattr(serve_cli, "build_replicas", lambda _args: deployment)
    with pytest.raises(CLIError, match=r"router could not be kept running .*stopping the deployment"):
        serve_cli.cmd_serve(build_parser().parse_args(["serve", "--replicas", "2"]))
    assert deployment.stopped >= 1
