"""A docker compose file for N TokenCake replicas behind vllm-router, generated from the code that runs them.

``tokencake serve --replicas N [options] --compose FILE`` writes it instead of starting anything.
Every command in it comes from the objects ``tokencake serve --replicas`` runs locally, so the two
cannot drift apart:

* ``replica-<i>``: ``python -m vllm.entrypoints.openai.api_server`` with exactly
  :meth:`ServerConfig.vllm_args` for these options, bound to ``0.0.0.0:8000`` in its container,
  and the variables :meth:`ServerConfig.child_env` sets for vLLM (not the caller's
  environment). The argv is the one for a machine like the one that writes the file (CPU or GPU,
  float32 on a CPU without bf16). Local paths in the argv (the model directory, a chat template) are mounted
  read-only under :data:`MOUNT_ROOT` and the argv points there.
* ``router``: ``vllm-router`` with :meth:`Router.router_args` in front of
  ``http://replica-<i>:8000``, published on the host's ``--port``.
* The API key is never written into the file: the replicas read ``${TOKENCAKE_API_KEY}`` when
  compose starts them (``${VAR:?}``: compose refuses to start without it), the router gets none.
* Supervision is docker's: ``restart: unless-stopped`` on every service, health checks on
  ``/health``, and the router starts once every replica is healthy. A dead replica's container is
  restarted; meanwhile the router keeps its sessions on the others (``router.py``).

The image (``deploy/Dockerfile``) must hold this package, vLLM and vllm-router; it is named by
``${TOKENCAKE_IMAGE}`` (default ``tokencake:latest``). ``docs/scale-out.md`` says which parts of
this recipe were run on which machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokencake.serving.event_api import EVENTS_API_KEY_ENV
from tokencake.serving.machine import http_url
from tokencake.serving.model import resolve_model
from tokencake.serving.router import Router
from tokencake.serving.server_config import ServerConfig
from tokencake.serving.transparent_events import EVENTS_URL_ENV

__all__ = [
    "CONTAINER_PORT",
    "MOUNT_ROOT",
    "ROUTER_PROMETHEUS_PORT",
    "compose_config",
    "local_commands",
    "render_compose",
]

#: Every replica's OpenAI port inside its container (the router's too).
CONTAINER_PORT = 8000
ROUTER_PROMETHEUS_PORT = 29000
#: Where local files named in vLLM's argv are mounted in the replica containers.
MOUNT_ROOT = "/mnt/tokencake"
_KEY_VARS = ("VLLM_API_KEY", EVENTS_API_KEY_ENV)
_KEY_REF = "${TOKENCAKE_API_KEY:?set TOKENCAKE_API_KEY: the replicas require an API key}"


def _health(port: int) -> dict[str, Any]:
    probe = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=5)"
    return {
        "test": ["CMD", "python", "-c", probe],
        "interval": "10s",
        "timeout": "10s",
        "retries": 3,
        "start_period": "600s",  # vLLM loads the model and profiles memory first
    }


def _escape(value: str) -> str:
    """A literal value for compose (``$`` starts an interpolation there)."""
    return value.replace("$", "$$")


def _mounts(argv: Sequence[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """``argv`` with local paths replaced by their mount points, and the mounts."""
    out: list[str] = []
    mounts: dict[str, str] = {}
    for arg in argv:
        path = Path(arg)
        if path.is_absolute() and path.exists():
            if arg not in mounts:
                mounts[arg] = f"{MOUNT_ROOT}/{len(mounts)}-{path.name}"
            out.append(mounts[arg])
        else:
            out.append(arg)
    volumes = [
        {"type": "bind", "source": src, "target": dst, "read_only": True} for src, dst in mounts.items()
    ]
    return out, volumes


def _replica_env(config: ServerConfig) -> dict[str, str]:
    """What ``child_env`` sets for vLLM, the key by reference."""
    env = {k: _escape(v) for k, v in config.child_env(base={}).items() if k not in _KEY_VARS}
    if config.api_key:
        env.update({name: _KEY_REF for name in _KEY_VARS})
    return dict(sorted(env.items()))


def compose_config(
    n: int,
    *,
    port: int = 8000,
    router_policy: str = "consistent_hash",
    image: str = "${TOKENCAKE_IMAGE:-tokencake:latest}",
    model: str | os.PathLike[str] | None = None,
    **server_kwargs: Any,
) -> dict[str, Any]:
    """The compose document (a dict) for ``n`` replicas built with ``server_kwargs`` (as for
    ``Replicas``) and a router published on the host's ``port``. Resolves the model (the bundled
    one is prepared on first use)."""
    if n < 1:
        raise ValueError(f"replicas must be >= 1, got {n}")
    for key in ("port", "host", "events_port", "log_file", "env"):
        server_kwargs.pop(key, None)  # per container, or host-specific
    server_kwargs.pop("startup_timeout", None)
    server_kwargs.pop("progress", None)
    config = ServerConfig(model, host="0.0.0.0", port=CONTAINER_PORT, **server_kwargs)
    config.resolved = resolve_model(model)
    argv, volumes = _mounts(config.vllm_args())
    services: dict[str, Any] = {}
    for i in range(n):
        service: dict[str, Any] = {
            "image": image,
            "command": ["python", "-m", "vllm.entrypoints.openai.api_server", *map(_escape, argv)],
            "environment": _replica_env(config),
            "init": True,
            "restart": "unless-stopped",
            "stop_grace_period": f"{int(config.kill_after)}s",
            "healthcheck": _health(CONTAINER_PORT),
        }
        if volumes:
            service["volumes"] = [dict(v) for v in volumes]  # own copies: no YAML anchors
        services[f"replica-{i}"] = service
    router = Router(
        [f"http://replica-{i}:{CONTAINER_PORT}" for i in range(n)],
        host="0.0.0.0",
        port=CONTAINER_PORT,
        policy=router_policy,
        prometheus_port=ROUTER_PROMETHEUS_PORT,
    )
    services["router"] = {
        "image": image,
        "command": ["vllm-router", *map(_escape, router.router_args())],
        "init": True,
        "restart": "unless-stopped",
        "ports": [f"{port}:{CONTAINER_PORT}"],
        "depends_on": {f"replica-{i}": {"condition": "service_healthy"} for i in range(n)},
        "healthcheck": {**_health(CONTAINER_PORT), "start_period": "30s"},
    }
    return {"name": "tokencake", "services": services}


def render_compose(doc: Mapping[str, Any]) -> str:
    """``doc`` as YAML, headed by how it was made and how to start it."""
    import yaml  # a vLLM dependency: present wherever the replicas can run

    key = "TOKENCAKE_API_KEY=... " if _KEY_REF in repr(doc) else ""
    head = [
        "# Generated by `tokencake serve --replicas ... --compose` (tokencake.serving.compose).",
        f"# Start: {key}docker compose up -d (image: deploy/Dockerfile)",
        "# Clients: tc.LLM('http://HOST:PORT/v1') through the router; stall events are derived.",
    ]
    body = yaml.safe_dump(dict(doc), sort_keys=False, default_flow_style=False, width=10_000)
    return "\n".join(head) + "\n" + body


def local_commands(
    doc: Mapping[str, Any],
    ports: Mapping[str, int],
    environ: Mapping[str, str] = os.environ,
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each service's command and environment as a process on this machine, without docker.

    How the recipe is checked where no container runtime runs (``scripts/compose_local.py``):
    ``ports[service]`` replaces the container port (a replica's events port follows it, + 1: in
    its ``--kv-transfer-config`` and in transparent mode's events URL),
    ``ports["router-prometheus"]`` the router's metrics port; service names become 127.0.0.1,
    bind-mount targets their host paths, ``${TOKENCAKE_API_KEY...}`` its value in ``environ``;
    ``python`` / ``vllm-router`` are this interpreter's.
    """
    names = list(doc["services"])
    out: dict[str, tuple[list[str], dict[str, str]]] = {}
    for name, service in doc["services"].items():
        mounts = {v["target"]: v["source"] for v in service.get("volumes", [])}
        events_port = ports[name] + 1
        argv: list[str] = []
        for arg in service["command"]:
            arg = mounts.get(arg, arg.replace("$$", "$"))
            for other in names:
                arg = arg.replace(f"http://{other}:{CONTAINER_PORT}", f"http://127.0.0.1:{ports[other]}")
            if argv and argv[-1] == "--port":
                arg = str(ports[name])
            elif argv and argv[-1] in ("--host", "--prometheus-host"):
                arg = "127.0.0.1"
            elif argv and argv[-1] == "--prometheus-port":
                arg = str(ports["router-prometheus"])
            elif argv and argv[-1] == "--kv-transfer-config":
                config = json.loads(arg)
                config["kv_connector_extra_config"]["events_port"] = events_port
                arg = json.dumps(config, separators=(",", ":"))
            argv.append(arg)
        if argv[0] == "python":
            argv[0] = sys.executable
        elif argv[0] == "vllm-router":
            argv[0] = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or argv[0]
        env = {k: _interpolate(v, environ) for k, v in service.get("environment", {}).items()}
        if EVENTS_URL_ENV in env:  # the replica's own listener, where its events port now is
            env[EVENTS_URL_ENV] = http_url("127.0.0.1", events_port)
        out[name] = (argv, env)
    return out


def _interpolate(value: str, environ: Mapping[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}`` and ``$$`` in one value."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        var, op, arg = match.group(1), match.group(2), match.group(3) or ""
        if environ.get(var):
            return environ[var]
        if op == ":?":
            raise ValueError(f"{var}: {arg}")
        return arg if op == ":-" else ""

    return re.sub(r"\$\$|\$\{(\w+)(?:(:[-?])([^}]*))?\}", one, value)
