"""``ServerConfig``'s rules through the public ``Server``, no process started: vLLM's argv and
environment, the connector's configuration, addresses, and the preflight refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tokencake.events import EVENTS_PORT_OFFSET
from tokencake.serving import machine
from tokencake.serving import server_config as cfgmod
from tokencake.serving.event_api import EVENTS_API_KEY_ENV
from tokencake.serving.model import ResolvedModel
from tokencake.serving.server import Server, ServerError
from tokencake.serving.tool_calling import BUNDLED_PARSER, FORCED_UNAVAILABLE_ENV, PARSER_PLUGIN
from tokencake.serving.transparent_events import EVENTS_URL_ENV as TRANSPARENT_EVENTS_URL_ENV


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
    assert int(_flag(args, "--kv-cache-memory-bytes")) == int(cfgmod.DEFAULT_CPU_KV_GIB * cfgmod.GIB)
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
    assert int(_flag(args, "--kv-cache-memory-bytes")) == cfgmod.GIB // 2
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
    assert _flag(_resolved(Server(port=1)).vllm_args(), "--scheduler-cls") == cfgmod.SPATIAL_SCHEDULER
    assert "--scheduler-cls" not in _resolved(Server(port=1, scheduler_cls=None)).vllm_args()
    assert "--scheduler-cls" not in _resolved(Server(port=1, baseline=True)).vllm_args()


def test_cpu_without_native_bf16_serves_float32(cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "--dtype" not in _resolved(Server(port=1)).vllm_args()
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda cpuinfo=None: False)
    args = _resolved(Server(port=1)).vllm_args()
    assert _flag(args, "--dtype") == "float32"
    assert int(_flag(args, "--kv-cache-memory-bytes")) == int(2 * cfgmod.DEFAULT_CPU_KV_GIB * cfgmod.GIB)
    # An explicit --dtype wins, and appears once.
    args = _resolved(Server(port=1, extra_args=["--dtype", "bfloat16"])).vllm_args()
    assert args.count("--dtype") == 1 and _flag(args, "--dtype") == "bfloat16"


#: ``/proc/cpuinfo`` flags of an AVX2-only host and of a host with native bf16 (AVX-512 bf16 + AMX).
CPU_FLAGS = {
    "avx2-only": "fpu vme de pse tsc msr sse sse2 ssse3 fma cx16 sse4_1 sse4_2 popcnt aes avx f16c avx2 bmi2",
    "bf16-amx": "fpu sse sse2 ssse3 fma sse4_2 avx f16c avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile",
}


@pytest.mark.parametrize("host", sorted(CPU_FLAGS))
def test_default_dtype_choice_on_both_cpu_flag_sets(
    host: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bundled model is served in float32 on every CPU: in bf16 it does not answer "Paris" to
    the capital of France on a native-bf16 host. Other models keep the speed rule (float32 only
    without native bf16), and ``--dtype`` wins everywhere. The machine's own CPU flags are read."""
    monkeypatch.setattr(machine, "cuda_available", lambda: False)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {CPU_FLAGS[host]}\n")
    monkeypatch.setattr(machine, "CPUINFO", cpuinfo)
    assert machine.cpu_has_bf16() == (host == "bf16-amx")
    marked = tmp_path / "smollm2"  # a prepared copy of the bundled model, given by path
    marked.mkdir()
    (marked / "tokencake-model.json").write_text(json.dumps({"name": "smollm2-135m-instruct"}))
    for resolved in (
        ResolvedModel("/models/smollm2", "smollm2-135m-instruct", is_default=True),
        ResolvedModel(str(marked), "smollm2"),
    ):
        server = Server(port=1)
        server.resolved = resolved
        args = server.vllm_args()
        assert _flag(args, "--dtype") == "float32", resolved
        assert int(_flag(args, "--kv-cache-memory-bytes")) == 2 * cfgmod.GIB  # as many blocks as bf16
    other = _resolved(Server(port=1)).vllm_args()
    assert _flag(other, "--dtype") == "float32" if host == "avx2-only" else "--dtype" not in other
    for dtype in ("bfloat16", "auto"):
        fast = Server(port=1, extra_args=["--dtype", dtype])
        fast.resolved = ResolvedModel("/models/smollm2", "smollm2-135m-instruct", is_default=True)
        args = fast.vllm_args()
        assert args.count("--dtype") == 1 and _flag(args, "--dtype") == dtype


def test_a_gpu_keeps_vllms_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cuda_available", lambda: True)
    server = Server(port=1)
    server.resolved = ResolvedModel("/models/smollm2", "smollm2-135m-instruct", is_default=True)
    assert "--dtype" not in server.vllm_args()


def test_gpu_default_leaves_kv_size_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cuda_available", lambda: True)
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


def test_transparent_mode_is_on_for_extension_servers_only(
    cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TRANSPARENT_EVENTS_URL_ENV, "http://inherited:1")  # never passed on as it is
    on = _resolved(Server(port=9100))
    args = on.vllm_args()
    assert _flag(args, "--middleware") == "tokencake.serving.transparent_asgi.TransparentMiddleware"
    assert (
        on.child_env()[TRANSPARENT_EVENTS_URL_ENV]
        == on.events_url
        == f"http://127.0.0.1:{9100 + EVENTS_PORT_OFFSET}"
    )
    keyed = Server(port=9100, api_key="sk-x").child_env()
    assert keyed[EVENTS_API_KEY_ENV] == "sk-x"  # the middleware authenticates to the listener with it
    for off in (Server(port=9100, transparent=False), Server(port=9100, baseline=True)):
        assert "--middleware" not in _resolved(off).vllm_args()
        assert TRANSPARENT_EVENTS_URL_ENV not in off.child_env()
    # A middleware of the user's own still loads, after ours.
    mine = _resolved(Server(port=9100, extra_args=["--middleware", "my.Mw"])).vllm_args()
    assert [a for i, a in enumerate(mine) if i and mine[i - 1] == "--middleware"][-1] == "my.Mw"


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
    assert cfgmod.gpu_only_flags(args) == expected


def test_preflight_missing_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "vllm_installed", lambda: False)
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
        if busy - EVENTS_PORT_OFFSET > 1024 and machine.port_is_free("127.0.0.1", busy - EVENTS_PORT_OFFSET):
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


def test_client_host() -> None:
    assert Server(host="0.0.0.0", port=7).base_url == "http://127.0.0.1:7/v1"
    assert Server(host="::", port=7).url == "http://[::1]:7"


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


def test_tool_calling_flags_for_the_bundled_model_and_others(cpu: None) -> None:
    """``tools=`` with tool_choice auto needs vLLM's parser flags (else HTTP 400 for every agent SDK)."""
    bundled = Server(port=1)
    bundled.resolved = ResolvedModel("/models/smollm2", "smollm2-135m-instruct", is_default=True)
    args = bundled.vllm_args()
    assert "--enable-auto-tool-choice" in args and _flag(args, "--tool-call-parser") == BUNDLED_PARSER
    assert _flag(args, "--tool-parser-plugin") == PARSER_PLUGIN
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


def test_a_server_that_cannot_constrain_forced_calls_says_why(
    cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reason reaches the vLLM process (whose bundled parser answers forced turns with 400)."""
    monkeypatch.setenv(FORCED_UNAVAILABLE_ENV, "stale, from the caller")

    def bundled(*extra: str, **kw: object) -> Server:
        server = Server(port=1, extra_args=list(extra), **kw)  # type: ignore[arg-type]
        server.resolved = ResolvedModel("/models/smollm2", "smollm2-135m-instruct", is_default=True)
        return server

    ok = bundled()
    assert ok.forced_tool_choice_problem() is None and FORCED_UNAVAILABLE_ENV not in ok.child_env()
    for server in (
        bundled("--structured-outputs-config", '{"backend": "outlines"}'),
        bundled("--structured-outputs-config.backend=lm-format-enforcer"),
        bundled("--structured-outputs-config", '{"backend": "outlines"}', baseline=True),
    ):
        problem = server.forced_tool_choice_problem()
        assert problem is not None and "cannot compile a tool call's grammar" in problem
        assert server.child_env()[FORCED_UNAVAILABLE_ENV] == problem
    # Not the bundled parser: nothing of ours answers the request, so nothing to pass on.
    stock = bundled("--structured-outputs-config", '{"backend": "outlines"}', tool_call_parser="hermes")
    assert stock.forced_tool_choice_problem() is None
    assert FORCED_UNAVAILABLE_ENV not in Server(port=1).child_env()  # model not resolved yet


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
