"""Several TokenCake servers behind vllm-router, each agent session kept on one replica.

For development on one machine (``tokencake serve --replicas N``); on a cluster the same three
pieces are deployed with the router's own tooling (``docs/scale-out.md``):

* N ordinary TokenCake servers (:class:`~tokencake.serving.server.Server`), each with its own
  ports, log and (on a CPU machine with enough cores) its own core;
* `vllm-router <https://github.com/vllm-project/router>`_ (PyPI ``vllm-router``, the ``router``
  extra) in front, with ``--policy consistent_hash``: it hashes the ``X-Session-ID`` header that
  ``tc.LLM`` and ``tc.openai_client`` put on every request, so an agent's turns land on the replica
  that holds its KV; requests without the header go wherever the hash of their other keys says;
* no events listener is reachable through the router, so clients use ``events_url=False``: their
  requests say ``stall_events: false`` and each replica derives the stalls of its own sessions from
  the requests it serves (``next_stall`` at the end of one, the session's next request). No second
  routing table.

``router_policy="round_robin"`` starts the same thing without affinity: the comparison point.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from tokencake.serving.model import tokencake_home
from tokencake.serving.server import Server, ServerError, find_free_port, stop_process_group

__all__ = ["ROUTER_POLICIES", "Replicas", "router_available"]

#: vllm-router policies offered here: affinity by session (the point), and the controls.
ROUTER_POLICIES = ("consistent_hash", "round_robin", "cache_aware", "power_of_two")


def router_available() -> bool:
    """Whether vllm-router is installed (``pip install 'tokencake[router]'``)."""
    try:
        import vllm_router  # noqa: F401
    except ImportError:
        return False
    return True


class Replicas:
    """``n`` TokenCake servers and a vllm-router in front; a context manager like ``Server``.

    ``server_kwargs`` go to every :class:`Server` (``num_gpu_blocks``, ``policy``, ...). On a CPU
    machine with at least ``n`` cores each replica's OpenMP threads are bound to their own cores.
    """

    def __init__(
        self,
        n: int,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        router_policy: str = "consistent_hash",
        log_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 600.0,
        progress: bool = False,
        **server_kwargs: Any,
    ) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"replicas must be an int >= 1, got {n!r}")
        if router_policy not in ROUTER_POLICIES:
            raise ValueError(
                f"router policy must be one of {', '.join(ROUTER_POLICIES)}, got {router_policy!r}"
            )
        for key in ("port", "events_port", "log_file"):
            if key in server_kwargs:
                raise ValueError(f"{key} is per replica: Replicas chooses it")
        self.n, self.host, self.port, self.router_policy = n, host, port, router_policy
        self.log_dir = Path(log_dir) if log_dir is not None else tokencake_home() / "logs"
        self.startup_timeout = startup_timeout
        self.progress = progress
        self.server_kwargs = server_kwargs
        self.servers: list[Server] = []
        self.prometheus_port: int | None = None  # the router's metrics (chosen at start)
        self._router: subprocess.Popen[bytes] | None = None
        self._router_log: Any = None

    @property
    def base_url(self) -> str:
        """The router's OpenAI base URL (what clients use)."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def model(self) -> str | None:
        """The name clients send as ``model`` (every replica serves the same)."""
        return self.servers[0].model if self.servers else None

    def _cores(self, i: int) -> dict[str, str]:
        cores = os.cpu_count() or 1
        if self.n <= 1 or cores < self.n:
            return {}
        per = cores // self.n
        if per == 1:  # one core each: nothing left to reserve for the API server's threads
            return {"VLLM_CPU_OMP_THREADS_BIND": str(i), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        return {"VLLM_CPU_OMP_THREADS_BIND": f"{i * per}-{(i + 1) * per - 1}"}

    def start(self) -> Replicas:
        if not router_available():
            raise ServerError("vllm-router is not installed: pip install 'tokencake[router]'")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(self.n):
                env = {**self._cores(i), **dict(self.server_kwargs.get("env") or {})}
                kwargs = {**self.server_kwargs, "env": env or None}
                server = Server(
                    log_file=self.log_dir / f"replica-{i}.log",
                    startup_timeout=self.startup_timeout,
                    progress=self.progress,
                    **kwargs,
                )
                self.servers.append(server)
                server.start()
            self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def router_command(self) -> list[str]:
        workers = [f"http://{s.host}:{s.port}" for s in self.servers]
        exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
        cmd = [exe] if exe else [sys.executable, "-m", "vllm_router.launch_router"]
        return [
            *cmd,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--worker-urls",
            *workers,
            "--policy",
            self.router_policy,
            "--log-dir",
            str(self.log_dir / "router"),
            # Its own Prometheus listener, on a free port (the default one may be taken).
            "--prometheus-host",
            self.host,
            "--prometheus-port",
            str(self.prometheus_port or find_free_port(self.host, with_events=False)),
        ]

    def _start_router(self) -> None:
        if not self.port:
            self.port = find_free_port(self.host, with_events=False)
        self.prometheus_port = self.prometheus_port or find_free_port(self.host, with_events=False)
        self._router_log = (self.log_dir / "router.log").open("wb")
        self._router = subprocess.Popen(
            self.router_command(),
            stdin=subprocess.DEVNULL,
            stdout=self._router_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 120.0
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self._router.poll() is not None:
                    raise ServerError(
                        f"vllm-router exited with code {self._router.returncode} "
                        f"(log: {self.log_dir / 'router.log'})"
                    )
                try:
                    if client.get(self.base_url + "/models").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    log = self.log_dir / "router.log"
                    raise ServerError(f"vllm-router did not answer within 120 s (log: {log})")
                time.sleep(0.5)

    def stop(self) -> None:
        router, self._router = self._router, None
        if router is not None and router.poll() is None:
            stop_process_group(router.pid, router.pid, grace=10.0)
        if self._router_log is not None:
            self._router_log.close()
            self._router_log = None
        for server in self.servers:
            server.stop()

    def stats(self) -> list[dict[str, Any]]:
        """Every replica's ``/v1/stats`` (the extension's counters), in replica order."""
        return [s.stats() for s in self.servers]

    def __enter__(self) -> Replicas:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> Sequence[str]:
        lines = [f"router ({self.router_policy}): {self.base_url}"]
        lines += [f"replica {i}: {s.base_url}  events {s.events_url}" for i, s in enumerate(self.servers)]
        return lines
