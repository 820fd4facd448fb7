"""``tokencake serve`` / ``stop`` / ``model``: run stock vLLM with the TokenCake extension.

``serve`` runs in the foreground until Ctrl-C or SIGTERM (then stops every vLLM process), or with
``--detach`` leaves the server running and records it under ``$TOKENCAKE_HOME/run/`` for
``tokencake stop``. Expected failures (bad model path, busy port, missing wheel, GPU flags on a
CPU machine, vLLM not installed) are one ``CLIError`` line, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from tokencake.cli import CLIError
from tokencake.serving.policies import DEFAULT_POLICY, POLICY_NAMES

#: Port of ``tokencake serve`` when none is given: what ``tc.LLM()`` expects by default.
DEFAULT_PORT = 8000


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="start vLLM + the TokenCake extension (default model: bundled SmolLM2-135M)",
        description=(
            "Start stock vLLM's OpenAI server with the TokenCake KV connector. Extra vLLM arguments go "
            "after `--`, e.g. `tokencake serve -- --max-num-seqs 8`."
        ),
    )
    p.add_argument("--model", help="HF model directory or hub id (default: the bundled SmolLM2-135M)")
    p.add_argument("--served-model-name", help="name clients use (default: derived from --model)")
    p.add_argument("--host", default="127.0.0.1", help="OpenAI bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"OpenAI port (default {DEFAULT_PORT})")
    p.add_argument(
        "--events-host",
        help="events listener bind address (default 127.0.0.1 whatever --host is; another needs a key)",
    )
    p.add_argument("--events-port", type=int, help="events port (default: --port + 1)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("TOKENCAKE_API_KEY"),
        help="require this API key (prefer $TOKENCAKE_API_KEY: other users can read a command line)",
    )
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-gib", type=float, help="device KV cache size in GiB (CPU default: 1)")
    kv.add_argument("--num-gpu-blocks", type=int, help="device KV cache size in blocks")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--host-pool-gib", type=float, help="host KV pool size in GiB")
    pool.add_argument("--host-pool-blocks", type=int, help="host KV pool size in blocks")
    p.add_argument("--max-model-len", type=int, default=4096, help="context length (default 4096)")
    p.add_argument("--baseline", action="store_true", help="stock vLLM without the extension")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--eager", dest="eager", action="store_true", default=True, help="no compile (default)")
    mode.add_argument("--compile", dest="eager", action="store_false", help="torch.compile (slow start)")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="start N servers behind vllm-router (session affinity by X-Session-ID; needs the "
        "'router' extra); --port is then the router's and --port + 1 the supervisor's status "
        "(/v1/stats: replicas up, restarts). A dead replica or router is restarted",
    )
    p.add_argument(
        "--router-policy",
        default="consistent_hash",
        choices=("consistent_hash", "round_robin", "cache_aware", "power_of_two"),
        help="with --replicas: vllm-router's policy (default consistent_hash: a session stays put)",
    )
    p.add_argument(
        "--compose",
        metavar="FILE",
        help="write a docker compose file for --replicas N (the replicas' vLLM commands and the "
        "router's, as this machine would run them) to FILE ('-': stdout) and exit; starts nothing",
    )
    p.add_argument("--scheduler-cls", help="vLLM --scheduler-cls to load with the extension")
    spatial = p.add_mutually_exclusive_group()
    spatial.add_argument(
        "--spatial",
        dest="spatial",
        action="store_true",
        default=None,
        help="the spatial scheduler (the default with the extension): admit waiting requests by "
        "TokenCake's spatial score (critical path first, DAG position, waiting time, preemptions); "
        "evict critical-path sessions' idle KV last and keep their held chains as a bounded reserve "
        "(docs/policy.md §7)",
    )
    spatial.add_argument(
        "--no-spatial",
        dest="spatial",
        action="store_false",
        help="no spatial scheduler: vLLM's own admission order (--scheduling-policy priority, by the "
        "SDK's critical-path priority, then arrival)",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        help="vLLM tool-call parser for tools= requests: auto (by model family; hermes for the bundled "
        "model), none, or a vLLM parser name",
    )
    p.add_argument("--chat-template", help="chat template file (default: the model's own)")
    p.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default=DEFAULT_POLICY,
        help="extension: the KV policy (default tokencake; docs/policy.md compares them)",
    )
    p.add_argument("--no-offload", action="store_true", help="extension: never offload KV to host")
    p.add_argument("--no-prefetch", action="store_true", help="extension: no predictive prefetch")
    p.add_argument("--no-demand-load", action="store_true", help="extension: no load on a host hit")
    p.add_argument(
        "--no-transparent",
        action="store_true",
        help="extension: no transparent mode (by default the tool calls of plain OpenAI clients, "
        "which send no TokenCake metadata, become stalls too: docs/transparent.md)",
    )
    gpu = p.add_argument_group("GPU options (refused on a CPU-only machine)")
    gpu.add_argument("--device", help="cuda (CPU is used when no GPU is visible)")
    gpu.add_argument("--gpu-memory-utilization", type=float, help="fraction of GPU memory for vLLM")
    gpu.add_argument("--tensor-parallel-size", "-tp", type=int, help="GPUs per model replica")
    p.add_argument("--log-file", type=Path, help="vLLM log (default $TOKENCAKE_HOME/logs/...)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    p.add_argument("--detach", action="store_true", help="leave it running; stop with `tokencake stop`")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="extra vLLM arguments after `--`")
    p.set_defaults(func=cmd_serve)

    s = subparsers.add_parser("stop", help="stop servers started with `tokencake serve --detach`")
    s.add_argument("--port", type=int, help="only the server on this port (default: all)")
    s.set_defaults(func=cmd_stop)

    m = subparsers.add_parser("model", help="manage the bundled default model")
    msub = m.add_subparsers(dest="model_command", metavar="ACTION")
    prep = msub.add_parser("prepare", help="convert the bundled SmolLM2 GGUF into an HF directory (once)")
    prep.add_argument("--force", action="store_true", help="convert again even if already prepared")
    prep.add_argument("--dest", type=Path, help="target directory (default: the TokenCake cache)")
    prep.set_defaults(func=cmd_model_prepare)
    path = msub.add_parser("path", help="print the prepared model's directory (exit 1 if not prepared)")
    path.set_defaults(func=cmd_model_path)
    m.set_defaults(func=lambda _args: (m.print_help(), 0)[1])


# -- serve --------------------------------------------------------------------------------------


class _Terminated(Exception):
    """SIGTERM arrived: stop like on Ctrl-C."""


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise _Terminated()


def _run_dir() -> Path:
    from tokencake.serving.model import tokencake_home

    return tokencake_home() / "run"


def _extra_args(args: argparse.Namespace) -> list[str]:
    extra = list(args.vllm_args or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    if args.device:
        extra += ["--device", args.device]
    if args.gpu_memory_utilization is not None:
        extra += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.tensor_parallel_size is not None:
        extra += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    return extra


def _scheduler_cls(args: argparse.Namespace) -> str | None:
    """``--scheduler-cls`` for the server: the spatial scheduler unless told otherwise."""
    from tokencake.serving.server import SPATIAL_SCHEDULER

    spatial = getattr(args, "spatial", None)
    if spatial and args.scheduler_cls:
        raise CLIError("--spatial is a --scheduler-cls: give one of them")
    if spatial and args.baseline:
        raise CLIError("--spatial needs the extension: not with --baseline")
    if args.scheduler_cls:
        return args.scheduler_cls
    if spatial is False or args.baseline:
        return None
    return SPATIAL_SCHEDULER


def build_server(args: argparse.Namespace) -> Any:
    """The ``Server`` that ``tokencake serve`` would start for ``args`` (not started)."""
    from tokencake.serving.server import Server

    if args.port is not None and not 0 <= args.port < 65536:
        raise CLIError(f"--port {args.port} is out of range")
    if args.events_port is not None and not 0 < args.events_port < 65536:
        raise CLIError(f"--events-port {args.events_port} is out of range")
    for name in ("num_gpu_blocks", "host_pool_blocks", "max_model_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("kv_cache_gib", "host_pool_gib"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise CLIError(f"--{name.replace('_', '-')} must be > 0")
    return Server(args.model, port=args.port, log_file=args.log_file, **_server_kwargs(args))


def _server_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """What every server of ``tokencake serve`` shares (one, or each of ``--replicas``)."""
    return dict(
        host=args.host,
        api_key=args.api_key or None,
        baseline=args.baseline,
        num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_gib=args.kv_cache_gib,
        host_pool_blocks=args.host_pool_blocks,
        host_pool_gib=args.host_pool_gib,
        max_model_len=args.max_model_len,
        eager=args.eager,
        extra_args=_extra_args(args),
        events_port=args.events_port,
        events_host=args.events_host,
        served_model_name=args.served_model_name,
        scheduler_cls=_scheduler_cls(args),
        offload=not args.no_offload,
        prefetch=not args.no_prefetch,
        demand_load=not args.no_demand_load,
        transparent=not args.no_transparent,
        policy=None if args.baseline else args.policy,
        startup_timeout=args.startup_timeout,
        tool_call_parser=args.tool_call_parser,
        chat_template=args.chat_template,
        progress=True,
        watch_parent=not args.detach,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from tokencake.serving.model import ModelError
    from tokencake.serving.server import ServerError

    if getattr(args, "compose", None):
        return _write_compose(args)
    if getattr(args, "replicas", 1) != 1:
        return _serve_replicas(args)
    server = build_server(args)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        try:
            server.start()
        except (ServerError, ModelError) as exc:
            tail = getattr(exc, "log_tail", "")
            if tail:
                print(f"--- last lines of {server.log_path} ---\n{tail}\n---", file=sys.stderr)
            raise CLIError(str(exc)) from None
        _print_ready(server)
        if args.detach:
            state = server.detach()
            state_file = _run_dir() / f"server-{server.port}.json"
            state_file.parent.mkdir(parents=True, exist_ok=True)
            state_file.write_text(json.dumps(state, indent=2) + "\n")
            print(f"detached (pid {state['pid']}); stop it with: tokencake stop --port {server.port}")
            return 0
        print("Ctrl-C to stop.", flush=True)
        while server.running:
            time.sleep(0.5)
        tail = server.log_tail(30)
        print(f"--- last lines of {server.log_path} ---\n{tail}\n---", file=sys.stderr)
        server.stop()
        raise CLIError("vLLM exited unexpectedly")
    except (KeyboardInterrupt, _Terminated):
        return _stop_on_signal("vLLM", server.stop)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if not args.detach:
            server.stop()


def build_replicas(args: argparse.Namespace) -> Any:
    """The ``Replicas`` that ``tokencake serve --replicas N`` would start (not started)."""
    from tokencake.serving.replicas import Replicas

    if args.replicas < 1:
        raise CLIError("--replicas must be >= 1")
    for flag, given in (
        ("--detach", args.detach),
        ("--events-port", args.events_port is not None),
        ("--log-file", args.log_file is not None),
    ):
        if given:
            raise CLIError(f"{flag} is per server: not with --replicas (each replica gets its own)")
    build_server(args)  # the same checks as for one server
    kwargs = _server_kwargs(args)
    kwargs.pop("events_port")
    host = kwargs.pop("host")
    kwargs.pop("watch_parent")  # the replicas are children of this process either way
    return Replicas(
        args.replicas,
        port=args.port or 0,
        host=host,
        router_policy=args.router_policy,
        model=args.model,
        **kwargs,
    )


def _serve_replicas(args: argparse.Namespace) -> int:
    from tokencake.serving.model import ModelError
    from tokencake.serving.server import ServerError

    replicas = build_replicas(args)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        try:
            replicas.start()
        except (ServerError, ModelError, ValueError) as exc:
            raise CLIError(str(exc)) from None
        for line in replicas.describe():
            print(line, flush=True)
        print(
            f"clients: tc.LLM({replicas.base_url!r}) — no events listener behind a router: each "
            "replica derives its sessions' stalls from their requests (docs/scale-out.md). "
            "Ctrl-C to stop.",
            flush=True,
        )
        while replicas.failure is None:  # the supervisor restarts what dies, within its budget
            time.sleep(0.5)
        raise CLIError(f"{replicas.failure}: stopping the deployment")
    except (KeyboardInterrupt, _Terminated):
        return _stop_on_signal("the router and the replicas", replicas.stop)
    finally:
        signal.signal(signal.SIGTERM, previous)
        replicas.stop()


def _write_compose(args: argparse.Namespace) -> int:
    """``--compose FILE``: the deployment of ``--replicas N`` as a docker compose file."""
    from tokencake.serving.compose import compose_config, render_compose
    from tokencake.serving.model import ModelError

    replicas = build_replicas(args)  # the same checks as for starting it
    try:
        doc = compose_config(
            replicas.n, port=args.port, router_policy=replicas.router_policy, **replicas.server_kwargs
        )
    except (ModelError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    text = render_compose(doc)
    if args.compose == "-":
        sys.stdout.write(text)
    else:
        Path(args.compose).write_text(text)
        print(f"wrote {args.compose}: {replicas.n} replica(s) + vllm-router", file=sys.stderr)
    return 0


def _stop_on_signal(what: str, stop: Callable[[], None]) -> int:
    """Ctrl-C or SIGTERM: stop everything, say so, exit 0."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the shutdown short
    print(f"\nstopping {what} …", file=sys.stderr, flush=True)
    stop()
    print("stopped.", file=sys.stderr, flush=True)
    return 0


def _print_ready(server: Any) -> None:
    took = f" in {server.startup_s:.0f} s" if server.startup_s is not None else ""
    mode = "baseline (no extension)" if server.baseline else "TokenCake extension"
    print(f"vLLM ready{took} — {mode}, model {server.model}")
    print(f"  base URL:   {server.base_url}")
    if server.events_url:
        print(f"  events URL: {server.events_url}")
        if server.transparent:
            print("  transparent mode: on (plain OpenAI clients' tool calls become stalls; --no-transparent)")
    print(f"  log:        {server.log_path}")
    problem = server.forced_tool_choice_problem()
    if problem:
        print(f"  warning:    tool_choice 'required' / named function refused (HTTP 400): {problem}")
    print(f"  export TOKENCAKE_BASE_URL={server.base_url}", flush=True)


# -- stop ---------------------------------------------------------------------------------------


def _is_watchdog(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True  # no /proc: trust the state file
    return b"tokencake.serving._watchdog" in cmdline


def cmd_stop(args: argparse.Namespace) -> int:
    from tokencake.serving.server import stop_process_group

    run = _run_dir()
    files = sorted(run.glob("server-*.json")) if run.is_dir() else []
    if args.port is not None:
        files = [f for f in files if f.name == f"server-{args.port}.json"]
    if not files:
        where = f" on port {args.port}" if args.port is not None else ""
        raise CLIError(f"no detached tokencake server{where} is recorded in {run}")
    failed = 0
    for state_file in files:
        try:
            state: dict[str, Any] = json.loads(state_file.read_text())
            pid, pgid = int(state["pid"]), int(state["pgid"])
        except (OSError, ValueError, KeyError, TypeError):
            print(f"ignoring unreadable {state_file}", file=sys.stderr)
            state_file.unlink(missing_ok=True)
            continue
        if not _is_watchdog(pid):
            print(f"server on port {state.get('port')} is not running any more")
            state_file.unlink(missing_ok=True)
            continue
        print(f"stopping server on port {state.get('port')} (pid {pid}) …", flush=True)
        if stop_process_group(pgid, pid, grace=40.0):
            state_file.unlink(missing_ok=True)
            print("stopped.")
        else:
            failed += 1
            print(f"some processes of group {pgid} survived SIGKILL", file=sys.stderr)
    if failed:
        raise CLIError(f"{failed} server(s) did not stop")
    return 0


# -- model --------------------------------------------------------------------------------------


def cmd_model_prepare(args: argparse.Namespace) -> int:
    from tokencake.serving.model import ModelError, prepare_model

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        path = prepare_model(args.dest, force=args.force, log=say)
    except ModelError as exc:
        raise CLIError(str(exc)) from None
    print(path)
    return 0


def cmd_model_path(_args: argparse.Namespace) -> int:
    from tokencake.serving.model import default_model_dir, is_prepared

    path = default_model_dir()
    print(path)
    if not is_prepared(path):
        print("not prepared yet: run `tokencake model prepare`", file=sys.stderr)
        return 1
    return 0
