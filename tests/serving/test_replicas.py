"""``Replicas`` / ``tokencake serve --replicas``: what gets started, checked without starting it."""

from __future__ import annotations

import pytest

from tokencake.cli import CLIError, build_parser
from tokencake.cli import _serve as serve_cli
from tokencake.serving.replicas import ROUTER_POLICIES, Replicas, router_available


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="replicas"):
        Replicas(0)
    with pytest.raises(ValueError, match="router policy"):
        Replicas(2, router_policy="fastest")
    with pytest.raises(ValueError, match="per replica"):
        Replicas(2, port=8000, events_port=8001)
    assert "consistent_hash" in ROUTER_POLICIES and "round_robin" in ROUTER_POLICIES


def test_the_router_gets_every_replica_and_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    reps = Replicas(2, port=9000, router_policy="round_robin", num_gpu_blocks=40)
    reps.servers = [type("S", (), {"host": "127.0.0.1", "port": p})() for p in (9101, 9103)]
    cmd = reps.router_command()
    at = cmd.index("--worker-urls")
    assert cmd[at + 1 : at + 3] == ["http://127.0.0.1:9101", "http://127.0.0.1:9103"]
    assert cmd[cmd.index("--policy") + 1] == "round_robin" and cmd[cmd.index("--port") + 1] == "9000"
    assert reps.base_url == "http://127.0.0.1:9000/v1"
    assert reps.server_kwargs == {"num_gpu_blocks": 40}


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
