"""Several TokenCake servers behind vllm-router, each agent session kept on one replica, kept running.

For development on one machine (``tokencake serve --replicas N``); on a cluster the same pieces
are deployed with a container runtime (``docs/scale-out.md``, ``tokencake.serving.compose``):

* N ordinary TokenCake servers (:class:`~tokencake.serving.server.Server`), each with its own
  ports, log and (on a CPU machine with enough cores) its own cores;
* vllm-router in front (:class:`~tokencake.serving.router.Router`) with ``--policy
  consistent_hash``: it hashes the ``X-Session-ID`` header that ``tc.LLM`` and
  ``tc.openai_client`` put on every request, so an agent's turns land on the replica that holds
  its KV;
* a supervisor (:class:`~tokencake.serving.supervisor.Supervisor`): a replica or router that dies
  is restarted on its old port, with bounded retries and backoff. Meanwhile the router keeps
  sessions on live replicas: a session whose replica died is placed on another one, where its KV
  is recomputed (the first request there is a full prefill), and a request in flight on the dead
  replica is retried there by the router. Only when the router, or every replica, cannot be kept
  running does the deployment fail (:attr:`Replicas.failure`; ``tokencake serve`` then stops);
* a status listener on the router's port + 1 (the place of a single server's events listener):
  ``GET /v1/stats`` says which replicas are up and how often each restarted (the API key as for
  the events listener), and ``/health`` answers ``{"ok": true, "events": false}``. No events
  listener is reachable through the router, so clients send ``stall_events: false`` (``tc.LLM``
  finds that out from this listener by itself) and each replica derives the stalls of its own
  sessions from the requests it serves. No second routing table.

Secrets: the API key goes to the replicas as for one server (their environment) and to the
router's readiness probe (a header); the router process gets neither (``router.py``).

``router_policy="round_robin"`` starts the same thing without affinity: the comparison point.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokencake.events import EVENTS_PORT_OFFSET
from tokencake.serving.event_api import EventServer
from tokencake.serving.machine import find_free_port, http_url, port_is_free
from tokencake.serving.model import tokencake_home
from tokencake.serving.router import ROUTER_POLICIES, Router, router_available
from tokencake.serving.server import Server, ServerError
from tokencake.serving.server_config import DEFAULT_EVENTS_HOST
from tokencake.serving.supervisor import Member, RestartPolicy, Supervisor

__all__ = ["ROUTER_POLICIES", "Replicas", "RestartPolicy", "router_available"]

log = logging.getLogger("tokencake.replicas")


class Replicas:
    """``n`` TokenCake servers, a vllm-router in front, both supervised; a context manager like ``Server``.

    ``server_kwargs`` go to every :class:`Server` (``num_gpu_blocks``, ``policy``, ``api_key``, ...).
    On a CPU machine with at least ``n`` cores each replica's OpenMP threads are bound to their own
    cores. ``restart_policy`` bounds the restarts; ``supervise=False`` starts no supervisor (a dead
    replica then stays dead).
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
        restart_policy: RestartPolicy | None = None,
        supervise: bool = True,
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
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self.startup_timeout = startup_timeout
        self.progress = progress
        self.restart_policy = restart_policy or RestartPolicy()
        self.supervise = supervise
        self.server_kwargs = server_kwargs
        self.servers: list[Server] = []
        self.router: Router | None = None
        self.supervisor: Supervisor | None = None
        self._status: EventServer | None = None
        self._lock = threading.Lock()
        self._stopping = False

    # -- addresses ------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """The router's OpenAI base URL (what clients use)."""
        return http_url(self.host, self.port) + "/v1"

    @property
    def log_dir(self) -> Path:
        """The replicas' and the router's logs: ``log_dir``, else ``$TOKENCAKE_HOME/logs/replicas-<port>``
        (one directory per deployment: two on one machine do not write the same files)."""
        if self._log_dir is not None:
            return self._log_dir
        return tokencake_home() / "logs" / f"replicas-{self.port}"

    @property
    def status_host(self) -> str:
        return str(self.server_kwargs.get("events_host") or DEFAULT_EVENTS_HOST)

    @property
    def status_url(self) -> str:
        """The supervisor's listener (``/v1/stats``, ``/health``): the router's port + 1."""
        return http_url(self.status_host, self.port + EVENTS_PORT_OFFSET)

    @property
    def model(self) -> str | None:
        """The name clients send as ``model`` (every replica serves the same)."""
        return self.servers[0].model if self.servers else None

    @property
    def api_key(self) -> str | None:
        return self.server_kwargs.get("api_key") or None

    # -- building blocks ------------------------------------------------------------------------

    def _cores(self, i: int) -> dict[str, str]:
        cores = os.cpu_count() or 1
        if self.n <= 1 or cores < self.n:
            return {}
        per = cores // self.n
        if per == 1:  # one core each: nothing left to reserve for the API server's threads
            return {"VLLM_CPU_OMP_THREADS_BIND": str(i), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        return {"VLLM_CPU_OMP_THREADS_BIND": f"{i * per}-{(i + 1) * per - 1}"}

    def _server(self, i: int, port: int = 0) -> Server:
        env = {**self._cores(i), **dict(self.server_kwargs.get("env") or {})}
        kwargs = {**self.server_kwargs, "env": env or None}
        return Server(
            port=port,
            log_file=self.log_dir / f"replica-{i}.log",
            startup_timeout=self.startup_timeout,
            progress=self.progress,
            **kwargs,
        )

    def make_router(self) -> Router:
        """The router in front of the current replicas (not started)."""
        return Router(
            [s.url for s in self.servers],
            host=self.host,
            port=self.port,
            policy=self.router_policy,
            log_dir=self.log_dir,
            api_key=self.api_key,
        )

    def _members(self) -> list[Member]:
        members = [
            Member(
                f"replica-{i}",
                alive=lambda i=i: self.servers[i].running,
                exit_code=lambda i=i: self.servers[i].returncode,
                restart=lambda i=i: self._restart_replica(i),
                info=lambda i=i: self._replica_info(i),
                group="the replicas",
            )
            for i in range(self.n)
        ]
        router = Member(
            "router",
            alive=lambda: self.router is not None and self.router.running,
            exit_code=lambda: self.router.returncode if self.router is not None else None,
            restart=self._restart_router,
            info=lambda: {"url": self.base_url, "pid": self.router.pid if self.router else None},
            essential=True,
        )
        return [*members, router]

    def _replica_info(self, i: int) -> dict[str, Any]:
        server = self.servers[i]
        return {"url": server.base_url, "events_url": server.events_url, "pid": server.pid}

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> Replicas:
        if not router_available():
            raise ServerError("vllm-router is not installed: pip install 'tokencake[router]'")
        if not self.port:
            self.port = find_free_port(self.host, with_events=True, events_host=self.status_host)
        for host, port, what in (
            (self.host, self.port, "router port"),
            (self.status_host, self.port + EVENTS_PORT_OFFSET, "status port (router port + 1)"),
        ):
            if not 0 < port < 65536 or not port_is_free(host, port):
                raise ServerError(f"{what} {port} on {host} is not free (pick another --port)")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(self.n):
                self.servers.append(self._server(i))
                self.servers[-1].start()
            self.router = self.make_router()
            self.router.start()
            self.supervisor = Supervisor(self._members(), self.restart_policy, say=self._say)
            self._status = EventServer(
                self.status_host,
                self.port + EVENTS_PORT_OFFSET,
                None,
                stats_fn=self.status,
                api_key=self.api_key,
            ).start()
            if self.supervise:
                self.supervisor.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _say(self, line: str) -> None:
        log.warning("%s", line)
        if self.progress:
            print(f"tokencake replicas: {line}", file=sys.stderr, flush=True)

    def _restart_replica(self, i: int) -> None:
        with self._lock:
            if self._stopping:
                raise ServerError("the deployment is stopping")
            old = self.servers[i]
            old.stop()  # whatever is left of its process group, and its log file
            _keep_log(old.log_path)
            self.servers[i] = new = self._server(i, port=old.port)  # the router's worker URL
        new.start()

    def _restart_router(self) -> None:
        with self._lock:
            if self._stopping or self.router is None:
                raise ServerError("the deployment is stopping")
            router = self.router
            router.stop()
        router.start()

    def stop(self) -> None:
        """Stop the supervisor, the router and every replica (also one restarting). Idempotent."""
        with self._lock:
            self._stopping = True
        if self.supervisor is not None:
            self.supervisor.stop()
        if self._status is not None:
            self._status.close()
            self._status = None
        if self.router is not None:
            self.router.stop()
        for server in list(self.servers):
            server.stop()
        if self.supervisor is not None:
            self.supervisor.join_restarts()
            for server in list(self.servers):  # one a restart had just swapped in
                server.stop()

    def __enter__(self) -> Replicas:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what runs ------------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why the deployment cannot go on (the router or every replica given up); None while it can."""
        return self.supervisor.failure if self.supervisor is not None else None

    def status(self) -> dict[str, Any]:
        """The supervisor's view (what ``GET {status_url}/v1/stats`` answers): which replicas are up,
        how often each and the router restarted, the restart policy. No secret in it."""
        if self.supervisor is None:
            return {"router": None, "replicas": [], "replicas_up": 0, "failure": None}
        status = self.supervisor.status()
        members = status.pop("members")
        replicas = [m for m in members if m["name"] != "router"]
        return {
            "router": next(m for m in members if m["name"] == "router"),
            "replicas": replicas,
            "replicas_up": sum(m["up"] for m in replicas),
            **status,
        }

    def stats(self) -> list[dict[str, Any]]:
        """Every replica's ``/v1/stats`` (the extension's counters), in replica order."""
        return [s.stats() for s in self.servers]

    def describe(self) -> Sequence[str]:
        lines = [f"router ({self.router_policy}): {self.base_url}", f"status: {self.status_url}/v1/stats"]
        lines += [f"replica {i}: {s.base_url}  events {s.events_url}" for i, s in enumerate(self.servers)]
        return [*lines, f"logs: {self.log_dir}"]


def _keep_log(path: Path | None) -> None:
    """Move a dead replica's log aside (``replica-0.log`` → ``replica-0.log.1``, …): its restart
    writes a new one, and the lines that say why it died stay."""
    if path is None or not path.exists():
        return
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    try:
        path.rename(path.with_name(f"{path.name}.{n}"))
    except OSError:
        pass
