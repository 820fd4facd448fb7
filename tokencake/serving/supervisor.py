"""Keep a set of processes running: restart one that died, with bounded retries and backoff.

``Replicas`` (``tokencake serve --replicas``) supervises its vLLM replicas and its router with
this. Each :class:`Member` is polled; one found dead is restarted after a backoff
(:class:`RestartPolicy`: ``backoff_s``, doubling while restarts keep failing, at most
``max_backoff_s``), at most ``max_restarts`` times within ``window_s``. Past that it is given up
(state ``failed``): a process that dies again and again is broken, and restarting it forever
would hide that. A restart runs on a thread of its own, so a replica that takes a minute to start
never delays noticing another death.

:attr:`Supervisor.failure` says why the deployment cannot go on: an ``essential`` member (the
router) was given up, or every member of a ``group`` (all replicas) was. The owner decides what
to do then (``tokencake serve`` stops everything and exits 2).

Standard library only: no processes here, just the members' callables.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["Member", "RestartPolicy", "Supervisor"]

State = Literal["up", "waiting", "restarting", "failed"]


@dataclass(frozen=True)
class RestartPolicy:
    """How often and how soon a dead process is started again."""

    #: Restart attempts allowed within ``window_s``; one more death gives the member up.
    max_restarts: int = 5
    window_s: float = 600.0
    #: Wait before the first attempt; doubles with each failed attempt in a row.
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not (self.window_s > 0 and self.backoff_s >= 0 and self.max_backoff_s >= self.backoff_s):
            raise ValueError("need window_s > 0 and 0 <= backoff_s <= max_backoff_s")

    def delay(self, failed_in_a_row: int) -> float:
        """Seconds before the next attempt after ``failed_in_a_row`` failed attempts."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, failed_in_a_row))


class Member:
    """One supervised process, known by three callables.

    ``alive()`` is polled; ``exit_code()`` is read once it is dead; ``restart()`` cleans up what
    is left and starts it again, returning once it serves (raising when it could not start).
    ``info()`` adds fields to its status (URL, pid).
    """

    def __init__(
        self,
        name: str,
        *,
        alive: Callable[[], bool],
        exit_code: Callable[[], int | None],
        restart: Callable[[], None],
        info: Callable[[], dict[str, Any]] | None = None,
        essential: bool = False,
        group: str | None = None,
    ) -> None:
        self.name = name
        self.alive = alive
        self.exit_code = exit_code
        self.restart = restart
        self.info = info
        self.essential = essential
        self.group = group
        self.state: State = "up"
        #: Restarts that brought it back / attempts that failed to.
        self.restarts = 0
        self.failed_restarts = 0
        self.last_exit: int | None = None
        self.last_error: str | None = None
        #: Seconds from noticing the last death until it served again.
        self.last_outage_s: float | None = None
        self.down_since: float | None = None
        self.next_try_at = 0.0
        self._failed_in_a_row = 0
        self._attempts: deque[float] = deque()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "state": self.state,
            "up": self.state == "up",
            "restarts": self.restarts,
            "failed_restarts": self.failed_restarts,
            "last_exit": self.last_exit,
            "last_error": self.last_error,
            "last_outage_s": None if self.last_outage_s is None else round(self.last_outage_s, 1),
        }
        if self.info is not None:
            try:
                out.update(self.info())
            except Exception as exc:  # a status must never fail
                out["info_error"] = type(exc).__name__
        return out


class Supervisor:
    """Polls ``members`` every ``poll_s`` on a daemon thread (:meth:`start`) and restarts the dead.

    ``say`` gets one line per event (a death, a restart, a member given up). ``clock`` is for
    tests. :meth:`check` is one pass of the loop.
    """

    def __init__(
        self,
        members: Sequence[Member],
        policy: RestartPolicy | None = None,
        *,
        say: Callable[[str], None] = lambda _line: None,
        poll_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.members = list(members)
        self.policy = policy or RestartPolicy()
        self.say = say
        self.poll_s = poll_s
        self.clock = clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._restarting: dict[str, threading.Thread] = {}

    # -- loop -----------------------------------------------------------------------------------

    def start(self) -> Supervisor:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tokencake-supervisor", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """No more checks or restarts; waits ``timeout`` for the loop (not for restarts: see
        :meth:`join_restarts`, after the owner stopped the processes a restart may be waiting on)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def join_restarts(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._restarting.values())
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()

    def check(self) -> None:
        """Notice deaths, start due restarts."""
        now = self.clock()
        for m in self.members:
            with self._lock:
                if self._stop.is_set():
                    return
                if m.state == "up" and not _safe(m.alive, True):
                    m.last_exit = _safe(m.exit_code, None)
                    m.down_since = now
                    self.say(f"{m.name} exited (code {m.last_exit})")
                    self._schedule(m, now)
                if m.state == "waiting" and now >= m.next_try_at and m.name not in self._restarting:
                    m.state = "restarting"
                    m._attempts.append(now)
                    thread = threading.Thread(
                        target=self._restart, args=(m,), name=f"tokencake-restart-{m.name}", daemon=True
                    )
                    self._restarting[m.name] = thread
                    thread.start()

    def _schedule(self, m: Member, now: float) -> None:
        """After a death or a failed attempt: the next attempt, or give the member up."""
        while m._attempts and now - m._attempts[0] > self.policy.window_s:
            m._attempts.popleft()
        if len(m._attempts) >= self.policy.max_restarts:
            m.state = "failed"
            self.say(
                f"{m.name} given up: {len(m._attempts)} restart(s) in the last "
                f"{self.policy.window_s:g} s (the limit)"
            )
            return
        delay = self.policy.delay(m._failed_in_a_row)
        m.state = "waiting"
        m.next_try_at = now + delay
        self.say(
            f"restarting {m.name} in {delay:g} s "
            f"(attempt {len(m._attempts) + 1} of {self.policy.max_restarts} per {self.policy.window_s:g} s)"
        )

    def _restart(self, m: Member) -> None:
        try:
            m.restart()
        except Exception as exc:
            error = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
            with self._lock:
                m.failed_restarts += 1
                m._failed_in_a_row += 1
                m.last_error = error
                if not self._stop.is_set():
                    self.say(f"{m.name} did not start: {error}")
                    self._schedule(m, self.clock())
        else:
            with self._lock:
                m.restarts += 1
                m._failed_in_a_row = 0
                m.last_error = None
                m.state = "up"
                if m.down_since is not None:
                    m.last_outage_s = self.clock() - m.down_since
                m.down_since = None
                if not self._stop.is_set():
                    self.say(f"{m.name} is back (down {m.last_outage_s or 0.0:.0f} s)")
        finally:
            with self._lock:
                self._restarting.pop(m.name, None)

    # -- what the owner reads -------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why the deployment cannot go on (None while it can)."""
        with self._lock:
            for m in self.members:
                if m.essential and m.state == "failed":
                    return f"{m.name} could not be kept running ({m.last_error or f'exit {m.last_exit}'})"
            groups: dict[str, list[Member]] = {}
            for m in self.members:
                if m.group is not None:
                    groups.setdefault(m.group, []).append(m)
            for group, ms in groups.items():
                if all(m.state == "failed" for m in ms):
                    return f"every member of {group} was given up"
        return None

    def status(self) -> dict[str, Any]:
        """Every member's state and restart counts, and the policy (JSON-able)."""
        with self._lock:
            members = [m.status() for m in self.members]
        failure = self.failure  # takes the lock itself
        return {"members": members, "restart_policy": asdict(self.policy), "failure": failure}


def _safe(call: Callable[[], Any], default: Any) -> Any:
    try:
        return call()
    except Exception:
        return default
