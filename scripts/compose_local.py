"""Run the commands of a compose file from ``tokencake serve --replicas N --compose FILE`` without docker.

Where no container runtime runs, this is how the recipe is checked: every service's command and
environment, exactly as written in the file, become local processes (``compose.local_commands``:
its own ports instead of the containers' 8000, 127.0.0.1 instead of service names, the mounted
paths' host sources, ``${TOKENCAKE_API_KEY}`` from this environment). Each runs under the watchdog,
so nothing outlives this script. Then, through the router: ``GET /v1/models`` with the key (200)
and without (401), and one keyed chat completion with a session header.

    TOKENCAKE_API_KEY=... python scripts/compose_local.py compose.yml

Prints one JSON summary (seconds until each service answered, the checks) and exits 1 when a
check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tokencake.events import SESSION_HEADER
from tokencake.serving.compose import local_commands
from tokencake.serving.machine import find_free_port
from tokencake.serving.process_group import stop_process_group


def _wait(url: str, headers: dict[str, str], timeout: float, proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, headers=headers, timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("compose_file", type=Path)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for each service to answer")
    args = parser.parse_args()
    doc = yaml.safe_load(args.compose_file.read_text())
    key = os.environ.get("TOKENCAKE_API_KEY", "")
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    ports = {name: find_free_port(with_events=name != "router") for name in doc["services"]}
    ports["router-prometheus"] = find_free_port(with_events=False)
    commands = local_commands(doc, ports)
    logs = Path(tempfile.mkdtemp(prefix="compose-local-"))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    summary: dict[str, Any] = {"compose_file": str(args.compose_file), "logs": str(logs), "answered_s": {}}
    checks: dict[str, bool] = {}
    try:
        order = [n for n in doc["services"] if n != "router"] + ["router"]  # depends_on: replicas first
        for name in order:
            argv, env = commands[name]
            watchdog = [sys.executable, "-m", "tokencake.serving._watchdog", "--parent", str(os.getpid())]
            procs[name] = subprocess.Popen(
                [*watchdog, "--grace", "20", "--", *argv],
                env={**os.environ, **env},
                stdout=(logs / f"{name}.log").open("wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            started = time.monotonic()
            url = f"http://127.0.0.1:{ports[name]}" + ("/v1/models" if name == "router" else "/health")
            checks[f"{name} answered"] = _wait(url, auth, args.timeout, procs[name])
            summary["answered_s"][name] = round(time.monotonic() - started, 1)
            if not checks[f"{name} answered"]:
                break
        else:
            base = f"http://127.0.0.1:{ports['router']}/v1"
            checks["keyless request refused (401)"] = httpx.get(base + "/models", timeout=10).status_code == (
                401 if key else 200
            )
            model = httpx.get(base + "/models", headers=auth, timeout=10).json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
            reply = httpx.post(
                base + "/chat/completions",
                json=body,
                headers={**auth, SESSION_HEADER: "compose:s1"},
                timeout=300,
            )
            checks["keyed chat completion through the router"] = reply.status_code == 200
    finally:
        for proc in reversed(procs.values()):
            stop_process_group(proc.pid, proc.pid, grace=30)
    summary["checks"] = checks
    print(json.dumps(summary, indent=2))
    return 0 if checks and all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
