"""``ServerConfig``: what a TokenCake vLLM server is, before any process runs.

Settings (validated on construction), the addresses they give, and every rule that turns them
into vLLM's argv and environment, plus the checks that can fail before launching. ``Server``
(``server.py``) adds the process: this module only probes the machine (``machine.py``).

The extension is plain vLLM configuration: the KV connector via ``--kv-transfer-config``
(``kv_connector_module_path`` points into this package), priority scheduling, and
``--shutdown-timeout`` so the connector's ``shutdown()`` runs, and, unless ``transparent=False``,
transparent mode: the ``--middleware`` that turns plain OpenAI clients' tool calls into stalls
(``transparent_asgi.py``; the events URL reaches it in the environment). ``baseline`` drops all
of that: the same server without the extension, the comparison point.

Both modes pin ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: configuring a connector otherwise changes the
CPU thread reservation, hence bf16 reduction order and greedy outputs (see vllm-notes.md).

Secrets and exposure: the API key never appears in vLLM's argv (readable by every local user in
``/proc``) or in vLLM's logged arguments: it travels in the vLLM child's environment only, as
``VLLM_API_KEY`` for the OpenAI port and ``TOKENCAKE_EVENTS_API_KEY`` for the events listener.
The events listener binds to loopback unless ``events_host`` says otherwise, whatever ``host``
is, and a non-loopback ``events_host`` requires an API key.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokencake.events import EVENTS_PORT_OFFSET
from tokencake.serving import machine
from tokencake.serving.event_api import EVENTS_API_KEY_ENV, is_loopback
from tokencake.serving.model import DEFAULT_MODEL_NAME, ResolvedModel
from tokencake.serving.policies import POLICY_NAMES
from tokencake.serving.server_error import ServerError
from tokencake.serving.tool_calling import (
    BUNDLED_PARSER,
    FORCED_UNAVAILABLE_ENV,
    forced_choice_problem,
    is_bundled_dir,
    tool_calling_args,
)
from tokencake.serving.transparent_asgi import MIDDLEWARE as TRANSPARENT_MIDDLEWARE
from tokencake.serving.transparent_events import EVENTS_URL_ENV as TRANSPARENT_EVENTS_URL_ENV

#: Where vLLM loads our connector from (``kv_connector`` and ``kv_connector_module_path``).
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


class ServerConfig:
    """A vLLM OpenAI server's settings and everything derived from them, without a process.

    ``Server`` is this plus the process; ``resolved`` (the model) is set by ``Server.start``
    before :meth:`vllm_args` can build the argv.
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
        transparent: bool = True,
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
        #: Transparent mode (``transparent_asgi.py``): plain OpenAI clients' tool calls become
        #: stalls. Extension servers only; a baseline server never loads it.
        self.transparent = transparent
        self.resolved: ResolvedModel | None = None
        self._cpu: bool | None = None

    # -- addresses ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Root URL (``http://host:port``)."""
        return machine.http_url(self.host, self.port)

    @property
    def base_url(self) -> str:
        """OpenAI base URL (``http://host:port/v1``)."""
        return self.url + "/v1"

    @property
    def events_url(self) -> str | None:
        """The extension's events endpoint root; None for a baseline server."""
        if self.baseline:
            return None
        return machine.http_url(self.events_host, self._events_port())

    @property
    def model(self) -> str:
        """The name clients send as ``model``."""
        if self.served_model_name:
            return self.served_model_name
        if self.resolved is not None:
            return self.resolved.served_name
        return str(self._model_arg) if self._model_arg else DEFAULT_MODEL_NAME

    def _events_port(self) -> int:
        return self.events_port if self.events_port is not None else self.port + EVENTS_PORT_OFFSET

    # -- command line ---------------------------------------------------------------------------

    def is_cpu(self) -> bool:
        """True when vLLM will run on the CPU backend (no CUDA device visible)."""
        if self._cpu is None:
            self._cpu = not machine.cuda_available()
        return self._cpu

    def bundled(self) -> bool:
        """True when the resolved model is the bundled SmolLM2 (by name, or a prepared copy by path)."""
        resolved = self.resolved
        return resolved is not None and (resolved.is_default or is_bundled_dir(resolved.source))

    def cpu_float32(self) -> bool:
        """Serve in float32 on the CPU backend unless ``--dtype`` is given explicitly: the bundled
        model on every CPU, any other model on a CPU without native bf16.

        The bundled model is small enough that quality comes first: in bf16 on an AMX host it
        answered "What is the capital of France?" with "L'Étoile, …" (float32: Paris). Without native
        bf16, vLLM-CPU's bf16 linear layers take a slow path (``machine.cpu_has_bf16``). Both
        systems of a comparison get the same dtype (the rule depends on model and machine only).
        """
        if not self.is_cpu() or _flag_value(self.extra_args, "--dtype") is not None:
            return False
        return self.bundled() or not machine.cpu_has_bf16()

    def tool_args(self) -> list[str]:
        """vLLM's tool-calling flags for the resolved model (``tokencake.serving.tool_calling``)."""
        if self.resolved is None:
            raise RuntimeError("resolve the model first (start() does)")
        return tool_calling_args(
            bundled=self.bundled(),
            model_dir=self.resolved.source,
            parser=self.tool_call_parser,
            chat_template=self.chat_template,
            extra_args=self.extra_args,
        )

    def forced_tool_choice_problem(self) -> str | None:
        """Why this server will refuse forced tool calls (HTTP 400 from the bundled parser); None
        when it constrains them, or when the bundled parser is not in use. Needs the model resolved."""
        if _flag_value(self.tool_args(), "--tool-call-parser") != BUNDLED_PARSER:
            return None
        return forced_choice_problem(
            _flag_value(self.extra_args, "--structured-outputs-config"),
            _flag_value(self.extra_args, "--structured-outputs-config.backend"),
        )

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
        args += self.tool_args()
        if not self.baseline:
            args += ["--scheduling-policy", "priority"]
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config(), separators=(",", ":"))]
            if self.scheduler_cls:
                args += ["--scheduler-cls", self.scheduler_cls]
            if self.transparent:
                args += ["--middleware", TRANSPARENT_MIDDLEWARE]
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

    def child_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The vLLM processes' environment: ``base`` (default: this process's) plus what vLLM
        needs here; the only place the API key is handed over. ``base={}`` gives just those."""
        env = dict(os.environ if base is None else base)
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"  # same thread layout with and without connector
        env["PYTHONUNBUFFERED"] = "1"
        if self.kv_cache_gib is not None or self.is_cpu():
            # The legacy variable would silently override --kv-cache-memory-bytes.
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.update(self.env)
        env.pop(FORCED_UNAVAILABLE_ENV, None)  # the server's own finding, never inherited
        env.pop(TRANSPARENT_EVENTS_URL_ENV, None)  # set only where the middleware is loaded
        if self.transparent and self.events_url is not None:
            env[TRANSPARENT_EVENTS_URL_ENV] = self.events_url
        problem = self.forced_tool_choice_problem() if self.resolved is not None else None
        if problem:
            env[FORCED_UNAVAILABLE_ENV] = problem
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
        if not machine.vllm_installed():
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
            if not machine.port_is_free(self.host, self.port):
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
            if not machine.port_is_free(self.events_host, ep):
                raise ServerError(
                    f"events port {ep} on {self.events_host} is already in use "
                    "(pick another --port or --events-port)"
                )


__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "DEFAULT_CPU_KV_GIB",
    "DEFAULT_EVENTS_HOST",
    "GIB",
    "SPATIAL_SCHEDULER",
    "ProgressFn",
    "ServerConfig",
    "gpu_only_flags",
]
