"""vllm-router as one process of a deployment: its argv, environment, readiness and shutdown.

`vllm-router <https://github.com/vllm-project/router>`_ (PyPI ``vllm-router``, the ``router``
extra) runs in front of the replicas. :class:`Router` starts it the way ``Server`` starts vLLM:
under the watchdog (``_watchdog.py``) as the leader of a new session, so that it never outlives
its owner (a SIGKILLed ``tokencake serve`` included) and stopping it stops its whole group.

What the router is told (:meth:`Router.router_args`):

* the workers, the policy, a log directory, a Prometheus listener on a free port;
* :data:`FAILOVER_ARGS`: vllm-router's defaults keep a dead worker in its hash ring for minutes
  (health checks every 60 s). With these, three failed attempts open the worker's circuit breaker
  and the router retries the request on a live worker — a request in flight on a worker that dies
  included — and health checks every 2 s put a restarted worker back.

What it is not told: the API key. It forwards each client's ``Authorization`` header to the
workers unchanged (a keyless client gets the workers' 401), and its own health checks use
``/health``, which vLLM leaves open. So the key is in neither its argv nor its environment, which
is an allow-list (:data:`ROUTER_ENV`: no key variables, no proxy settings that would send worker
traffic elsewhere). Readiness is ``GET /v1/models`` through the router, with the key.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import httpx

from tokencake.serving.machine import client_host, find_free_port, http_url
from tokencake.serving.process_group import stop_child
from tokencake.serving.server_error import ServerError

__all__ = [
    "FAILOVER_ARGS",
    "ROUTER_ENV",
    "ROUTER_POLICIES",
    "Router",
    "router_available",
    "router_env",
]

#: vllm-router policies offered here: affinity by session (the point), and the controls.
ROUTER_POLICIES = ("consistent_hash", "round_robin", "cache_aware", "power_of_two")

#: Failover settings (see the module doc): breaker after 3 failures, half-open after 5 s, health
#: checks every 2 s.
FAILOVER_ARGS = (
    "--cb-failure-threshold",
    "3",
    "--cb-timeout-duration-secs",
    "5",
    "--health-check-interval-secs",
    "2",
)

#: The caller's environment variables the router gets; nothing else (no key, no proxy).
ROUTER_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "PYTHONPATH",
    "PYTHONHOME",
    "VIRTUAL_ENV",
    "LD_LIBRARY_PATH",
    "RUST_LOG",
    "RUST_BACKTRACE",
)


def router_available() -> bool:
    """Whether vllm-router is installed (``pip install 'tokencake[router]'``)."""
    try:
        import vllm_router  # noqa: F401
    except ImportError:
        return False
    return True


def router_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The router's environment: the :data:`ROUTER_ENV` subset of ``environ``."""
    return {name: environ[name] for name in ROUTER_ENV if name in environ}


class Router:
    """One vllm-router process in front of ``worker_urls``; ``start`` waits until it serves.

    Restartable: ``stop`` then ``start`` again runs a new process on the same port.
    """

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        policy: str = "consistent_hash",
        log_dir: str | os.PathLike[str] | None = None,
        api_key: str | None = None,
        prometheus_port: int | None = None,
        ready_timeout: float = 120.0,
        grace: float = 10.0,
        watch_parent: bool = True,
        python: str | None = None,
    ) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
        self.worker_urls = list(worker_urls)
        self.host, self.port, self.policy = host, port, policy
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.api_key = api_key or None
        #: Its metrics port: the one given, else a free one chosen at each start.
        self.prometheus_port = prometheus_port
        self._fixed_prometheus = prometheus_port is not None
        self.ready_timeout = ready_timeout
        self.grace = grace
        self.watch_parent = watch_parent
        self.python = python or sys.executable
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    # -- addresses and command line -------------------------------------------------------------

    @property
    def url(self) -> str:
        return http_url(client_host(self.host), self.port)

    @property
    def base_url(self) -> str:
        """The OpenAI base URL clients use."""
        return self.url + "/v1"

    @property
    def log_path(self) -> Path | None:
        return self.log_dir / "router.log" if self.log_dir is not None else None

    def executable(self) -> list[str]:
        """The ``vllm-router`` console script next to this Python, else its module."""
        exe = shutil.which("vllm-router", path=str(Path(self.python).parent))
        return [exe] if exe else [self.python, "-m", "vllm_router.launch_router"]

    def router_args(self) -> list[str]:
        """vllm-router's argv after the executable (no secret in it)."""
        args = ["--host", self.host, "--port", str(self.port), "--worker-urls", *self.worker_urls]
        args += ["--policy", self.policy]
        if self.log_dir is not None:
            args += ["--log-dir", str(self.log_dir / "router")]
        if self.prometheus_port is not None:
            # Its own listener on a chosen port (the default one may be taken).
            args += ["--prometheus-host", self.host, "--prometheus-port", str(self.prometheus_port)]
        return [*args, *FAILOVER_ARGS]

    def command(self) -> list[str]:
        """The full argv: watchdog → vllm-router."""
        parent = os.getpid() if self.watch_parent else 0
        watchdog = [self.python, "-m", "tokencake.serving._watchdog", "--parent", str(parent)]
        return [*watchdog, "--grace", str(self.grace), "--", *self.executable(), *self.router_args()]

    # -- process --------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    @property
    def pid(self) -> int | None:
        """pid of its watchdog (the process group leader)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> Router:
        """Launch it and wait until ``/v1/models`` answers through it; ServerError otherwise."""
        if self._proc is not None:
            raise RuntimeError("router already started")
        if not router_available():
            raise ServerError("vllm-router is not installed: pip install 'tokencake[router]'")
        if not self.port:
            self.port = find_free_port(self.host, with_events=False)
        if not self._fixed_prometheus:  # a restart must not fail on a port taken meanwhile
            self.prometheus_port = find_free_port(self.host, with_events=False)
        log_path = self.log_path
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = log_path.open("ab")  # appended: a restart keeps the crash's lines
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log if self._log is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            env=router_env(),
            start_new_session=True,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        deadline = time.monotonic() + self.ready_timeout
        status: int | str = "no answer"
        with httpx.Client(timeout=5.0) as client:
            while True:
                proc = self._proc
                if proc is None:
                    raise ServerError(f"vllm-router on {self.url} was stopped while starting")
                if proc.poll() is not None:
                    raise ServerError(
                        f"vllm-router exited with code {proc.returncode} (log: {self.log_path})"
                    )
                try:
                    status = client.get(self.base_url + "/models", headers=headers).status_code
                except httpx.HTTPError:
                    status = "no answer"
                if status == 200:
                    return
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"vllm-router did not answer within {self.ready_timeout:.0f} s "
                        f"(last: {status}; log: {self.log_path})"
                    )
                time.sleep(0.5)

    def stop(self) -> None:
        """Stop it and its watchdog (idempotent)."""
        proc, self._proc = self._proc, None
        log, self._log = self._log, None
        stop_child(proc, log, grace=self.grace + 5.0)
