"""The real vllm-router binary in front of stand-in workers: what ``Router`` and ``Replicas`` rely on.

A session's requests (``X-Session-ID``) all reach one worker, the router forwards the TokenCake
fields (``kv_transfer_params``, ``priority``) untouched and each client's ``Authorization``
header, a keyed deployment becomes ready, the router process has neither the key nor the
caller's environment, and it dies with its owner. No vLLM: the workers are small HTTP servers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokencake.events import SESSION_HEADER
from tokencake.serving.process_group import group_alive
from tokencake.serving.router import ROUTER_ENV, Router, router_env

KEY = "router-test-key-5b1f"


@pytest.fixture
def stubs(stub_worker: Callable[..., Any]) -> list[Any]:
    return [stub_worker(), stub_worker()]


@pytest.fixture
def router(stubs: list[Any], tmp_path: Path) -> Iterator[Router]:
    r = Router([s.url for s in stubs], log_dir=tmp_path)
    try:
        yield r.start()
    finally:
        r.stop()


def _chat(sid: str) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "priority": 7,
        "kv_transfer_params": {"tokencake": {"session_id": sid, "stall_events": False}},
    }


def test_sessions_stick_to_a_worker_and_tokencake_fields_pass(router: Router, stubs: list[Any]) -> None:
    # 32 sessions: with a balanced hash ring the chance that all land on one worker is 2**-31, so a
    # failure of the spread check below means the router sent everything to one worker.
    sessions = [f"app:agent-{i}" for i in range(32)]
    with httpx.Client(timeout=30.0) as client:
        for _turn in range(3):
            for sid in sessions:
                resp = client.post(
                    router.base_url + "/chat/completions", json=_chat(sid), headers={SESSION_HEADER: sid}
                )
                assert resp.status_code == 200, resp.text
    where: dict[str, set[int]] = {}
    for i, stub in enumerate(stubs):
        for item in stub.seen:
            where.setdefault(item["session"], set()).add(i)
            assert item["body"]["priority"] == 7
            assert item["body"]["kv_transfer_params"]["tokencake"]["session_id"] == item["session"]
    assert sorted(where) == sorted(sessions)
    assert all(len(workers) == 1 for workers in where.values()), where  # every session stayed put
    assert router.log_path is not None
    log = router.log_path.read_text(errors="replace")[-3000:]
    spread = [len(stub.seen) for stub in stubs]
    assert all(spread), f"all sessions on one worker {spread}; router log tail:\n{log}"


def test_a_keyed_deployment_is_ready_and_keyless_clients_get_401(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stub_worker: Callable[..., Any]
) -> None:
    """The workers require a key (vLLM's ``--api-key``): the readiness probe must send it, and the
    router forwards each client's own header (it is told no key)."""
    monkeypatch.setenv("TOKENCAKE_API_KEY", KEY)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    keyed = [stub_worker(key=KEY), stub_worker(key=KEY)]
    r = Router([s.url for s in keyed], log_dir=tmp_path, api_key=KEY, ready_timeout=30.0)
    try:
        t0 = time.monotonic()
        r.start()
        assert time.monotonic() - t0 < 30
        url = r.base_url + "/chat/completions"
        assert httpx.post(url, json=_chat("s"), headers={SESSION_HEADER: "s"}).status_code == 401
        wrong = {SESSION_HEADER: "s", "Authorization": "Bearer nope"}
        assert httpx.post(url, json=_chat("s"), headers=wrong).status_code == 401
        ok = httpx.post(url, json=_chat("s"), headers={SESSION_HEADER: "s", "Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
        # Neither the router nor its watchdog has the key in argv or environment, nor the
        # caller's other variables (a proxy setting would send worker traffic elsewhere).
        assert r.pid is not None
        procs = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid(p) == r.pid]
        assert len(procs) >= 2  # the watchdog and vllm-router
        for proc in procs:
            environ = (proc / "environ").read_bytes().split(b"\0")
            names = {e.split(b"=", 1)[0].decode() for e in environ if e}
            assert names <= set(ROUTER_ENV), names - set(ROUTER_ENV)
            assert KEY.encode() not in (proc / "environ").read_bytes()
            assert KEY.encode() not in (proc / "cmdline").read_bytes()
        assert KEY not in r.log_path.read_text(errors="replace")  # type: ignore[union-attr]
    finally:
        r.stop()


def _pgid(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, ValueError, IndexError):
        return None


def test_router_env_is_an_allow_list() -> None:
    environ = {
        "PATH": "/bin",
        "HOME": "/h",
        "TOKENCAKE_API_KEY": "k",
        "VLLM_API_KEY": "k",
        "TOKENCAKE_EVENTS_API_KEY": "k",
        "HTTP_PROXY": "http://p",
        "AWS_SECRET_ACCESS_KEY": "s",
    }
    assert router_env(environ) == {"PATH": "/bin", "HOME": "/h"}


def test_the_router_dies_with_its_owner(stubs: list[Any], tmp_path: Path) -> None:
    """SIGKILL of the owner (``tokencake serve --replicas``) runs no cleanup: the router's
    watchdog notices and stops it, as the vLLM servers' watchdogs do."""
    owner = textwrap.dedent(
        f"""
        import time
        from tokencake.serving.router import Router
        r = Router({[s.url for s in stubs]!r}, log_dir={str(tmp_path)!r}, grace=2.0).start()
        print(r.pid, r.url, flush=True)
        time.sleep(3600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert proc.stdout is not None
        pgid_text, url = proc.stdout.readline().split()
        pgid = int(pgid_text)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 20
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not group_alive(pgid), "vllm-router survived its owner"
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_command_line_has_failover_settings_and_no_key(tmp_path: Path) -> None:
    r = Router(["http://127.0.0.1:9101", "http://127.0.0.1:9103"], port=9000, policy="round_robin",
               log_dir=tmp_path, api_key=KEY, prometheus_port=9200)  # fmt: skip
    cmd = r.command()
    assert cmd[cmd.index("--parent") + 1] == str(os.getpid())  # under the watchdog
    at = cmd.index("--worker-urls")
    assert cmd[at + 1 : at + 3] == ["http://127.0.0.1:9101", "http://127.0.0.1:9103"]
    assert cmd[cmd.index("--policy") + 1] == "round_robin" and cmd[cmd.index("--port") + 1] == "9000"
    assert cmd[cmd.index("--cb-failure-threshold") + 1] == "3"
    assert cmd[cmd.index("--health-check-interval-secs") + 1] == "2"
    assert KEY not in " ".join(cmd) and "--api-key" not in cmd
    assert r.base_url == "http://127.0.0.1:9000/v1"
    with pytest.raises(ValueError, match="router policy"):
        Router([], policy="fastest")
    # vllm-router's own parser takes the argv (the compose recipe runs it as is).
    from vllm_router.launch_router import parse_router_args

    parsed = parse_router_args(r.router_args())
    assert (parsed.policy, parsed.cb_failure_threshold, parsed.api_key) == ("round_robin", 3, None)
