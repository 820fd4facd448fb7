"""Server launcher without vLLM: argv/env building, preflight errors, and the process lifecycle.

The lifecycle tests swap vLLM for a tiny stand-in (an HTTP server answering /health and
/v1/models that also forks a SIGTERM-ignoring "EngineCore"), so they exercise the real watchdog,
readiness polling, early-exit detection and the no-orphan guarantees in a few seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tokencake.events import EVENTS_PORT_OFFSET
from tokencake.serving import server as srvmod
from tokencake.serving.event_api import EVENTS_API_KEY_ENV
from tokencake.serving.model import ModelError, ResolvedModel
from tokencake.serving.server import Server, ServerError


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only machine with native bf16 (no dtype override)."""
    monkeypatch.setattr(srvmod, "cuda_available", lambda: False)
    monkeypatch.setattr(srvmod, "vllm_installed", lambda: True)
    monkeypatch.setattr(srvmod, "cpu_has_bf16", lambda cpuinfo=None: True)


def _resolved(server: Server, source: str = "/models/m", name: str = "m") -> Server:
    server.resolved = ResolvedModel(source, name)
    return server


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_extension_args(cpu: None) -> None:
    s = _resolved(
        Server(
            port=9100,
            num_gpu_blocks=40,
            host_pool_blocks=64,
            extra_args=["--max-num-seqs", "4"],
        )
    )
    args = s.vllm_args()
    assert _flag(args, "--model") == "/models/m"
    assert _flag(args, "--served-model-name") == "m"
    assert _flag(args, "--port") == "9100"
    assert _flag(args, "--host") == "127.0.0.1"
    assert _flag(args, "--max-model-len") == "4096"
    assert _flag(args, "--num-gpu-blocks-override") == "40"
    assert _flag(args, "--scheduling-policy") == "priority"
    assert int(_flag(args, "--shutdown-timeout")) > 0
    assert int(_flag(args, "--kv-cache-memory-bytes")) == int(srvmod.DEFAULT_CPU_KV_GIB * srvmod.GIB)
    assert "--enforce-eager" in args and "--enable-prefix-caching" in args
    assert args[-2:] == ["--max-num-seqs", "4"]
    kv = json.loads(_flag(args, "--kv-transfer-config"))
    assert kv["kv_connector"] == "TokenCakeConnector"
    assert kv["kv_role"] == "kv_both"
    assert kv["kv_connector_module_path"] == "tokencake.serving.vllm.connector"
    extra = kv["kv_connector_extra_config"]
    assert extra["events_port"] == 9100 + EVENTS_PORT_OFFSET
    assert extra["events_host"] == "127.0.0.1"
    assert "api_key" not in extra
    assert extra["host_pool_blocks"] == 64
    assert extra["offload"] is extra["prefetch"] is extra["demand_load"] is True
    assert "host_pool_gib" not in extra
    assert s.events_url == f"http://127.0.0.1:{9100 + EVENTS_PORT_OFFSET}"
    assert s.base_url == "http://127.0.0.1:9100/v1"


def test_baseline_args_have_no_extension(cpu: None) -> None:
    s = _resolved(Server(port=9100, baseline=True, kv_cache_gib=0.5, eager=False))
    args = s.vllm_args()
    assert "--kv-transfer-config" not in args
    assert "--scheduling-policy" not in args
    assert "--enforce-eager" not in args
    assert int(_flag(args, "--kv-cache-memory-bytes")) == srvmod.GIB // 2
    assert s.events_url is None


def test_connector_options(cpu: None) -> None:
    s = Server(
        port=9100,
        events_port=9300,
        host_pool_gib=2.5,
        offload=False,
        prefetch=False,
        demand_load=False,
        scheduler_cls="pkg.Sched",
        connector_config={"extra_knob": 3},
    )
    _resolved(s)
    extra = s.kv_transfer_config()["kv_connector_extra_config"]
    assert extra["events_port"] == 9300 and extra["host_pool_gib"] == 2.5 and extra["extra_knob"] == 3
    assert extra["offload"] is extra["prefetch"] is extra["demand_load"] is False
    assert "api_key" not in extra
    assert _flag(s.vllm_args(), "--scheduler-cls") == "pkg.Sched"
    assert s.events_url == "http://127.0.0.1:9300"


def test_the_spatial_scheduler_is_the_default_with_the_extension(cpu: None) -> None:
    assert _flag(_resolved(Server(port=1)).vllm_args(), "--scheduler-cls") == srvmod.SPATIAL_SCHEDULER
    assert "--scheduler-cls" not in _resolved(Server(port=1, scheduler_cls=None)).vllm_args()
    assert "--scheduler-cls" not in _resolved(Server(port=1, baseline=True)).vllm_args()


def test_cpu_without_native_bf16_serves_float32(cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "--dtype" not in _resolved(Server(port=1)).vllm_args()
    monkeypatch.setattr(srvmod, "cpu_has_bf16", lambda cpuinfo=None: False)
    args = _resolved(Server(port=1)).vllm_args()
    assert _flag(args, "--dtype") == "float32"
    assert int(_flag(args, "--kv-cache-memory-bytes")) == int(2 * srvmod.DEFAULT_CPU_KV_GIB * srvmod.GIB)
    # An explicit --dtype wins, and appears once.
    args = _resolved(Server(port=1, extra_args=["--dtype", "bfloat16"])).vllm_args()
    assert args.count("--dtype") == 1 and _flag(args, "--dtype") == "bfloat16"


def test_cpu_bf16_detection_reads_cpu_flags() -> None:
    assert srvmod.cpu_has_bf16("processor : 0\nflags : fpu sse avx2 avx512f avx512_bf16\n")
    assert srvmod.cpu_has_bf16("flags\t\t: fpu amx_bf16 amx_tile\n")
    assert not srvmod.cpu_has_bf16("flags : fpu sse avx2 fma\n")
    assert srvmod.cpu_has_bf16("no flags line at all")  # unknown: keep vLLM's default dtype


def test_gpu_default_leaves_kv_size_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(srvmod, "cuda_available", lambda: True)
    assert "--kv-cache-memory-bytes" not in _resolved(Server(port=1)).vllm_args()


def test_explicit_kv_bytes_in_extra_args_win(cpu: None) -> None:
    args = _resolved(Server(port=1, extra_args=["--kv-cache-memory-bytes", "123"])).vllm_args()
    assert args.count("--kv-cache-memory-bytes") == 1


def test_invalid_options() -> None:
    with pytest.raises(ValueError, match="not both"):
        Server(host_pool_blocks=1, host_pool_gib=1.0)
    with pytest.raises(ValueError):
        Server(num_gpu_blocks=0)
    with pytest.raises(ValueError):
        Server(kv_cache_gib=0)
    with pytest.raises(ValueError, match="force-kills"):
        Server(shutdown_timeout=0)


def test_child_env_pins_thread_reservation(cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    env = Server(env={"FOO": "bar"}).child_env()
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["FOO"] == "bar"
    assert Server(baseline=True).child_env()["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"


def test_command_runs_vllm_under_the_watchdog(cpu: None) -> None:
    cmd = _resolved(Server(port=5)).command()
    assert cmd[1:3] == ["-m", "tokencake.serving._watchdog"]
    assert _flag(cmd, "--parent") == str(os.getpid())
    assert cmd[cmd.index("--") + 1 :][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    detached = _resolved(Server(port=5, watch_parent=False)).command()
    assert _flag(detached, "--parent") == "0"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--device", "cuda"], ["--device cuda"]),
        (["--device=cpu"], []),
        (["--gpu-memory-utilization", "0.5"], ["--gpu-memory-utilization"]),
        (["-tp", "2"], ["--tensor-parallel-size 2"]),
        (["--tensor-parallel-size=1"], []),
        (["--pipeline-parallel-size", "4"], ["--pipeline-parallel-size 4"]),
        (["--max-num-seqs", "8"], []),
    ],
)
def test_gpu_only_flags(args: list[str], expected: list[str]) -> None:
    assert srvmod.gpu_only_flags(args) == expected


def test_preflight_missing_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(srvmod, "vllm_installed", lambda: False)
    with pytest.raises(ServerError, match="vLLM is not installed"):
        Server().preflight()


def test_preflight_gpu_flags_on_cpu(cpu: None) -> None:
    with pytest.raises(ServerError, match="needs a CUDA GPU"):
        Server(extra_args=["--gpu-memory-utilization", "0.9"]).preflight()


def test_preflight_busy_ports(cpu: None) -> None:
    import socket

    # The main port under test must be free while its events port is busy: take an ephemeral port
    # whose lower neighbour is free (another process may hold any fixed one).
    for _ in range(100):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        if busy - EVENTS_PORT_OFFSET > 1024 and srvmod.port_is_free("127.0.0.1", busy - EVENTS_PORT_OFFSET):
            break
        sock.close()
    else:
        pytest.skip("no ephemeral port with a free neighbour on this machine")
    with sock:
        with pytest.raises(ServerError, match=f"port {busy} on 127.0.0.1 is already in use"):
            Server(port=busy).preflight()
        with pytest.raises(ServerError, match=f"events port {busy}"):
            Server(port=busy - EVENTS_PORT_OFFSET).preflight()
        Server(port=busy - EVENTS_PORT_OFFSET, baseline=True).preflight()  # no events port needed


def test_find_free_port_pair() -> None:
    port = srvmod.find_free_port()
    assert srvmod.port_is_free("127.0.0.1", port)
    assert srvmod.port_is_free("127.0.0.1", port + EVENTS_PORT_OFFSET)


def test_client_host() -> None:
    assert Server(host="0.0.0.0", port=7).base_url == "http://127.0.0.1:7/v1"
    assert Server(host="::", port=7).url == "http://[::1]:7"


def test_parse_prometheus() -> None:
    text = textwrap.dedent(
        """\
        # HELP vllm:prefix_cache_hits_total hits
        # TYPE vllm:prefix_cache_hits_total counter
        vllm:prefix_cache_hits_total{engine="0",model_name="m"} 128.0
        vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
        vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 5.0
        vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_cache_hit"} 2.0
        vllm:info{version="a,b"} 1
        process_open_fds 12
        garbage line
        """
    )
    m = srvmod.parse_prometheus(text)
    assert m["vllm:prefix_cache_hits_total"] == 128.0
    assert m['vllm:prompt_tokens_by_source_total{source="local_cache_hit"}'] == 7.0
    assert m['vllm:info{version="a,b"}'] == 1.0
    assert m["process_open_fds"] == 12.0
    assert not any(k.endswith("_created") or "_created{" in k for k in m)


def test_api_key_never_reaches_argv_or_the_logged_config(cpu: None) -> None:
    secret = "sk-tokencake-0123456789"
    for baseline in (False, True):
        s = _resolved(Server(port=9100, api_key=secret, baseline=baseline))
        cmd = s.command()
        assert secret not in " ".join(cmd)  # /proc/PID/cmdline is readable by every local user
        assert "--api-key" not in cmd
        assert secret not in json.dumps(s.kv_transfer_config())  # vLLM logs it in "non-default args"
        env = s.child_env()
        assert env["VLLM_API_KEY"] == secret  # vLLM's own OpenAI auth reads it (--api-key wins if given)
        assert env[EVENTS_API_KEY_ENV] == secret  # the connector's listener reads it in EngineCore
    assert s.state() and secret not in json.dumps(s.state())


def test_no_key_clears_inherited_key_variables(cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key left in the caller's environment must not make vLLM demand one this Server never sends."""
    monkeypatch.setenv("VLLM_API_KEY", "stale")
    monkeypatch.setenv(EVENTS_API_KEY_ENV, "stale")
    env = Server(port=1, env={EVENTS_API_KEY_ENV: "also-stale"}).child_env()
    assert "VLLM_API_KEY" not in env and EVENTS_API_KEY_ENV not in env


def test_events_bind_to_loopback_unless_asked(cpu: None) -> None:
    s = _resolved(Server(host="0.0.0.0", port=9100))
    extra = s.kv_transfer_config()["kv_connector_extra_config"]
    assert extra["events_host"] == "127.0.0.1"  # --host 0.0.0.0 alone does not expose events
    assert s.events_url == f"http://127.0.0.1:{9100 + EVENTS_PORT_OFFSET}"
    assert _flag(s.vllm_args(), "--host") == "0.0.0.0"
    exposed = _resolved(Server(host="0.0.0.0", port=9100, events_host="0.0.0.0", api_key="k"))
    assert exposed.kv_transfer_config()["kv_connector_extra_config"]["events_host"] == "0.0.0.0"


def test_exposed_events_need_a_key(cpu: None) -> None:
    with pytest.raises(ServerError, match=r"--events-host 0\.0\.0\.0 .*--api-key"):
        Server(events_host="0.0.0.0").preflight()
    Server(events_host="0.0.0.0", api_key="k").preflight()
    Server(events_host="::1").preflight()  # loopback: no key needed
    Server(events_host="0.0.0.0", baseline=True).preflight()  # no listener at all


# vLLM 0.32 log of `tokencake serve --num-gpu-blocks 24` (messages from vllm/v1/core/kv_cache_utils.py
# and vllm/v1/engine/utils.py; layout from vllm/logging_utils/formatter.py: continuation lines of a
# multi-line record are joined with "\r\n" + the prefix).
_E = "(EngineCore pid=4242) ERROR 12-01 10:00:03 [core.py:1510] "
KV_CAUSE = (
    "ValueError: To serve at least one request with the model's max seq len (4096), (0.09 GiB KV cache is "
    "needed, which is larger than the available KV cache memory (0.05 GiB). Based on the available memory, "
    "the estimated maximum model length is 2944. Try increasing `gpu_memory_utilization` (which also "
    "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. "
    "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)
KV_LOG = (
    "(APIServer pid=4200) INFO 12-01 10:00:00 [utils.py:286] non-default args: {'model': '/m'}\n"
    "(EngineCore pid=4242) INFO 12-01 10:00:02 [kv_cache_utils.py:2619] Overriding num_gpu_blocks=910 "
    "with num_gpu_blocks_override=24\n"
    + _E
    + "EngineCore failed to start.\r\n"
    + _E
    + "Traceback (most recent call last):\r\n"
    + _E
    + '  File "/v/vllm/v1/engine/core.py", line 1490, in run_engine_core\r\n'
    + _E
    + "    engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)\r\n"
    + _E
    + '  File "/v/vllm/v1/core/kv_cache_utils.py", line 1029, in _check_enough_kv_cache_memory\r\n'
    + _E
    + "    raise ValueError(\r\n"
    + _E
    + KV_CAUSE
    + "\n"
    "Process EngineCore:\n"
    "Traceback (most recent call last):\n"
    '  File "/usr/lib/python3.11/multiprocessing/process.py", line 314, in _bootstrap\n'
    "    self.run()\n"
    '  File "/v/vllm/v1/core/kv_cache_utils.py", line 1029, in _check_enough_kv_cache_memory\n'
    "    raise ValueError(\n" + KV_CAUSE + "\n"
    "(APIServer pid=4200) Traceback (most recent call last):\n"
    '(APIServer pid=4200)   File "<frozen runpy>", line 198, in _run_module_as_main\n'
    '(APIServer pid=4200)   File "/v/vllm/v1/engine/utils.py", line 1432, in wait_for_engine_startup\n'
    "(APIServer pid=4200)     raise RuntimeError(\n"
    "(APIServer pid=4200) RuntimeError: Engine core initialization failed. See root cause above. "
    "Failed core proc(s): {'EngineCore': 1}\n"
    "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: There appear to be 1 "
    "leaked shared_memory objects to clean up at shutdown\n"
    "  warnings.warn('resource_tracker: There appear to be %d '\n"
)


def test_startup_cause_is_the_engine_error_not_the_wrapper() -> None:
    assert srvmod.startup_cause(KV_LOG) == KV_CAUSE[:400] + "…"
    msg = srvmod.startup_error_message(1, KV_LOG)
    assert "\n" not in msg
    assert msg.startswith(
        "vLLM exited with code 1 while starting: ValueError: To serve at least one request with the "
        "model's max seq len (4096)"
    )
    assert "raise RuntimeError(" not in msg and "Engine core initialization failed" not in msg
    assert "gpu_memory_utilization" not in msg  # vLLM's engine-argument advice is replaced by ours
    assert msg.endswith(
        "— fix: the KV cache cannot hold one request of --max-model-len: lower --max-model-len "
        "(about 2944 fits) or give more KV with --num-gpu-blocks / --kv-cache-gib"
    )


@pytest.mark.parametrize(
    ("log", "cause", "hint"),
    [
        (
            "INFO 12-01 10:00:00 [x.py:1] starting\nTraceback (most recent call last):\n"
            '  File "a.py", line 1, in <module>\n    raise ValueError(\n'
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`\n",
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
            "lower --max-model-len",
        ),
        (
            "(APIServer pid=1) ERROR 12-01 10:00:00 [api_server.py:9] OSError: [Errno 98] Address "
            "already in use\n",
            "OSError: [Errno 98] Address already in use",
            "pick another --port",
        ),
        (
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
            "  Value error, Invalid repository ID or local directory specified: '/nope'. "
            "[type=value_error, input_value=ArgsKwargs((), {}), input_type=ArgsKwargs]\n",
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: Value error, "
            "Invalid repository ID or local directory specified: '/nope'.",
            "",
        ),
        (
            "(EngineCore pid=3) ERROR 12-01 10:00:00 [core.py:9] worker died unexpectedly\n"
            "(APIServer pid=2) RuntimeError: Engine core initialization failed. See root cause above.\n",
            "worker died unexpectedly",
            "",
        ),
        ("just some output\n    raise RuntimeError(\n", "", ""),
    ],
)
def test_startup_cause_and_hint(log: str, cause: str, hint: str) -> None:
    assert srvmod.startup_cause(log) == cause
    assert hint in srvmod.startup_hint(cause)
    if not cause:
        assert srvmod.startup_error_message(1, log, Path("/l.log")) == (
            "vLLM exited with code 1 while starting (log: /l.log)"
        )


def test_stats_of_baseline_is_an_error() -> None:
    with pytest.raises(ServerError, match="baseline"):
        Server(baseline=True).stats()


# ---------------------------------------------------------------------------------------------
# Lifecycle with a stand-in for vLLM
# ---------------------------------------------------------------------------------------------

FAKE_VLLM = """
import argparse, http.server, json, os, signal, subprocess, sys, time
p = argparse.ArgumentParser()
p.add_argument("--port", type=int)
p.add_argument("--host")
p.add_argument("--served-model-name")
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
        assert pgid is not None and srvmod.group_alive(pgid)
        assert srv.metrics()["vllm:prompt_tokens_total"] == 3.0
        assert json.loads(json.dumps(srv.state()))["port"] == srv.port
    assert not srv.running
    assert not srvmod.group_alive(pgid)  # the SIGTERM-ignoring grandchild was killed too
    assert ticks, "progress callback never called"
    srv.stop()  # idempotent


def test_early_exit_shows_the_cause(cpu: None, fake_python: str, model_dir: Path, tmp_path: Path) -> None:
    srv = _fake_server(fake_python, model_dir, tmp_path, "crash")
    with pytest.raises(ServerError, match=r"exited with code 3 .*ValueError: Available memory") as err:
        srv.start()
    assert "fake vllm starting" in err.value.log_tail
    assert not srv.running


def test_early_exit_names_the_kv_cause_and_fix(
    cpu: None, fake_python: str, model_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "vllm-output.txt"
    log.write_text(KV_LOG + "\n".join(f"(APIServer pid=4200) INFO shutdown line {i}" for i in range(40)))
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
        from tokencake.serving import server as m
        m.cuda_available = lambda: False
        m.vllm_installed = lambda: True
        s = m.Server({str(model_dir)!r}, python={fake_python!r}, env={{"FAKE_MODE": "ok"}},
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
        assert srvmod.group_alive(pgid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while srvmod.group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not srvmod.group_alive(pgid), "vLLM stand-in survived its owner"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_tool_calling_flags_for_the_bundled_model_and_others(cpu: None) -> None:
    """``tools=`` with tool_choice auto needs vLLM's parser flags (else HTTP 400 for every agent SDK)."""
    bundled = Server(port=1)
    bundled.resolved = ResolvedModel("/models/smollm2", "smollm2-135m-instruct", is_default=True)
    args = bundled.vllm_args()
    assert "--enable-auto-tool-choice" in args and _flag(args, "--tool-call-parser") == "hermes"
    assert _flag(args, "--chat-template").endswith("smollm2_tools.jinja")
    for baseline in (False, True):  # stock and extension servers speak the same API
        assert (
            "--tool-call-parser"
            in _resolved(Server(port=1, baseline=baseline, tool_call_parser="pythonic")).vllm_args()
        )
    assert "--enable-auto-tool-choice" not in _resolved(Server(port=1)).vllm_args()  # unknown family
    off = Server(port=1, tool_call_parser="none")
    off.resolved = ResolvedModel("/models/smollm2", "smollm2-135m-instruct", is_default=True)
    assert "--enable-auto-tool-choice" not in off.vllm_args()


def test_policy_reaches_the_connector_and_a_bad_one_is_refused() -> None:
    s = Server(policy="continuum", events_port=9301)
    _resolved(s)
    assert s.kv_transfer_config()["kv_connector_extra_config"]["policy"] == "continuum"
    default = Server(events_port=9302)
    _resolved(default)
    assert "policy" not in default.kv_transfer_config()["kv_connector_extra_config"]
    with pytest.raises(ValueError, match="unknown KV policy 'fifo'"):
        Server(policy="fifo")


def test_data_parallel_is_refused_with_the_extension(cpu: None) -> None:
    """One events listener and one stall book per server: DP engines would each miss the events."""
    for flags in (["--data-parallel-size", "2"], ["-dp=4"]):
        with pytest.raises(ServerError, match="replicas behind a router"):
            Server(extra_args=flags).preflight()
    Server(extra_args=["--data-parallel-size", "1"]).preflight()
    Server(baseline=True, extra_args=["--data-parallel-size", "2"]).preflight()  # stock vLLM: its call
