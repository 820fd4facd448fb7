"""The docker compose recipe: generated from ``vllm_args()`` / ``router_args()``, no key in it, a
well-formed compose file, and the router's container command runs as is (against stand-ins).

The replicas' container commands need vLLM and minutes: ``scripts/compose_local.py`` runs those
(``docs/scale-out.md`` reports it). No docker here: the file is checked structurally below and
against the compose-spec JSON schema when that run says so.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tokencake.cli import _serve as serve_cli
from tokencake.cli import build_parser
from tokencake.serving.compose import MOUNT_ROOT, compose_config, local_commands, render_compose
from tokencake.serving.machine import find_free_port
from tokencake.serving.process_group import stop_process_group
from tokencake.serving.server_config import ServerConfig
from tokencake.serving.transparent_events import EVENTS_URL_ENV

KEY = "compose-test-key-77e0"
SERVICE = re.compile(r"^[a-zA-Z0-9._-]+$")


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr("tokencake.serving.machine.cuda_available", lambda: False)
    d = tmp_path / "tiny-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return d


def _doc(model_dir: Path, **kw: Any) -> dict[str, Any]:
    return compose_config(2, port=8100, model=str(model_dir), num_gpu_blocks=40, **kw)


def test_each_replica_runs_exactly_the_servers_vllm_args(model_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "tools.jinja"
    template.write_text("{{ messages }}")
    doc = _doc(model_dir, api_key=KEY, chat_template=str(template))
    config = ServerConfig(
        str(model_dir), host="0.0.0.0", port=8000, num_gpu_blocks=40, api_key=KEY, chat_template=str(template)
    )
    from tokencake.serving.model import resolve_model

    config.resolved = resolve_model(str(model_dir))
    expected = config.vllm_args()
    for i in range(2):
        service = doc["services"][f"replica-{i}"]
        command = service["command"]
        assert command[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
        mounts = {v["target"]: v["source"] for v in service["volumes"]}
        assert [mounts.get(a, a) for a in command[3:]] == expected  # the same argv, paths mounted
        assert set(mounts.values()) == {str(model_dir.resolve()), str(template)}
        assert all(t.startswith(MOUNT_ROOT + "/") for t in mounts)
        assert all(v["read_only"] for v in service["volumes"])
        env = service["environment"]
        assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"  # what child_env sets, nothing of ours else
        assert env["VLLM_API_KEY"].startswith("${TOKENCAKE_API_KEY:?")
        assert service["restart"] == "unless-stopped" and "/health" in " ".join(
            service["healthcheck"]["test"]
        )


def test_the_key_is_never_in_the_file_and_keyless_replicas_get_none(model_dir: Path) -> None:
    keyed = render_compose(_doc(model_dir, api_key=KEY))
    assert KEY not in keyed and "TOKENCAKE_API_KEY=..." in keyed
    plain = _doc(model_dir)
    for i in range(2):
        assert not {"VLLM_API_KEY", "TOKENCAKE_EVENTS_API_KEY"} & set(
            plain["services"][f"replica-{i}"]["environment"]
        )
    assert "TOKENCAKE_API_KEY" not in render_compose(plain)


def test_the_file_is_well_formed_compose(model_dir: Path) -> None:
    doc = _doc(model_dir, api_key=KEY)
    text = render_compose(doc)
    assert "&id" not in text and "*id" not in text  # no YAML anchors
    parsed = yaml.safe_load(text)
    assert parsed == doc
    assert set(parsed) == {"name", "services"}
    services = parsed["services"]
    assert set(services) == {"replica-0", "replica-1", "router"} and all(SERVICE.match(s) for s in services)
    router = services["router"]
    assert router["ports"] == ["8100:8000"]
    assert router["depends_on"] == {f"replica-{i}": {"condition": "service_healthy"} for i in range(2)}
    assert "environment" not in router  # the router needs no key
    for service in services.values():
        assert isinstance(service["image"], str) and all(isinstance(a, str) for a in service["command"])
        assert set(service) <= {
            "image", "command", "environment", "init", "restart", "stop_grace_period",
            "healthcheck", "volumes", "ports", "depends_on",
        }  # fmt: skip
    from vllm_router.launch_router import parse_router_args

    args = parse_router_args(router["command"][1:])
    assert args.worker_urls == ["http://replica-0:8000", "http://replica-1:8000"]
    assert (args.policy, args.host, args.port, args.api_key) == ("consistent_hash", "0.0.0.0", 8000, None)


def test_the_cli_writes_it_and_starts_nothing(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "compose.yml"
    args = build_parser().parse_args(
        ["serve", "--replicas", "3", "--model", str(model_dir), "--api-key", KEY, "--compose", str(out)]
    )
    assert serve_cli.cmd_serve(args) == 0
    text = out.read_text()
    assert KEY not in text
    assert sorted(yaml.safe_load(text)["services"]) == ["replica-0", "replica-1", "replica-2", "router"]


def test_each_local_replica_reports_to_its_own_events_port(model_dir: Path) -> None:
    """Run without docker, every replica's connector listens on its own events port, and its
    transparent mode (the ``--middleware``) posts there, not to the container's port."""
    ports = {"replica-0": 9100, "replica-1": 9200, "router": 9300, "router-prometheus": 9400}
    commands = local_commands(_doc(model_dir), ports)
    for name in ("replica-0", "replica-1"):
        argv, env = commands[name]
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        port = kv["kv_connector_extra_config"]["events_port"]
        assert port == ports[name] + 1 and "--middleware" in argv
        assert env[EVENTS_URL_ENV] == f"http://127.0.0.1:{port}"
    assert EVENTS_URL_ENV not in commands["router"][1]


def test_the_routers_container_command_runs(
    model_dir: Path, tmp_path: Path, stub_worker: Callable[..., Any]
) -> None:
    """The router's command, localized (ports, service names), in front of two stand-in workers
    that require the key: keyed requests pass, keyless ones get 401."""
    stubs = [stub_worker(key=KEY), stub_worker(key=KEY)]
    doc = _doc(model_dir, api_key=KEY)
    ports = {f"replica-{i}": int(s.url.rsplit(":", 1)[1]) for i, s in enumerate(stubs)}
    ports["router"] = find_free_port(with_events=False)
    ports["router-prometheus"] = find_free_port(with_events=False)
    argv, env = local_commands(doc, ports, environ={"TOKENCAKE_API_KEY": KEY})["router"]
    assert env == {}
    replica_env = local_commands(doc, ports, environ={"TOKENCAKE_API_KEY": KEY})["replica-0"][1]
    assert replica_env["VLLM_API_KEY"] == KEY
    with pytest.raises(ValueError, match="TOKENCAKE_API_KEY"):
        local_commands(doc, ports, environ={})
    proc = subprocess.Popen(argv, stdout=(tmp_path / "router.log").open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{ports['router']}/v1/models"
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline:
            try:
                status = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=2).status_code
            except httpx.HTTPError:
                status = None
            if status == 200:
                break
            time.sleep(0.3)
        assert status == 200, (tmp_path / "router.log").read_text()[-2000:]
        assert httpx.get(url, timeout=5).status_code == 401
    finally:
        stop_process_group(proc.pid, proc.pid, grace=5)
