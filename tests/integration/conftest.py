"""Real vLLM-CPU servers for the integration tests; servers needed together start together.

ONE extension server serves the whole session, and a ``--baseline`` server with the same settings
serves the tests that compare answers with stock vLLM. The device KV is deliberately small
(``SERVER_SETTINGS``: 40 blocks of 128 tokens, max_model_len 4096) so that a handful of prompts
creates real eviction pressure. Both servers pin ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (``Server``
always does), so their greedy outputs are comparable.

Starting a server takes about a minute, most of it one core importing torch and vLLM. So servers
start on threads of their own (:class:`Boot`): the session servers that the selected tests use
start together when the first test that uses one of them is set up; a module whose tests need
servers of their own starts them together, or while its first tests run (the ``boot`` fixture).
No server starts before an integration test needs one: the other tests (some with tight timing
bounds) never share the CPU with a starting server.

Nothing is skipped silently: without the serve-cpu stack these fixtures FAIL with a message saying
how to install it, or how to deselect the tests (``-m "not integration"``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tokencake.serving import ModelError, Server, ServerError, find_free_port, find_gguf
from tokencake.serving.machine import vllm_installed

#: Settings shared by the extension and the baseline server (and by tests that start their own).
#: float32 pinned explicitly: the tests compare greedy answers, which change with the dtype, so every
#: host serves them in the same one whatever the default dtype rule picks (``serving/machine.py``).
SERVER_SETTINGS: dict[str, Any] = {
    "num_gpu_blocks": 40,
    "max_model_len": 4096,
    "extra_args": ["--dtype", "float32"],
}

_INTEGRATION_DIR = Path(__file__).parent
_timings: dict[str, float] = {}
#: The session's servers: fixture name → (log name, ``Server`` settings beyond ``SERVER_SETTINGS``).
SESSION_SERVERS: dict[str, tuple[str, dict[str, Any]]] = {
    "tokencake_server": ("tokencake", {}),
    "baseline_server": ("baseline", {"baseline": True}),
}
#: Every boot of the session (stopped at its end, whoever forgot to) and the ports given out.
_boots: list[Boot] = []
_ports: set[int] = set()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Everything under tests/integration is an integration test, marked or not.
    for item in items:
        if _INTEGRATION_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


def require_serve_stack() -> None:
    """Fail (never skip) when the serve-cpu stack is incomplete."""
    problems = []
    if not vllm_installed():
        problems.append("vllm is not installed")
    try:
        find_gguf()
    except ModelError as exc:
        problems.append(str(exc))
    if problems:
        pytest.fail(
            "integration tests need the serve-cpu stack (`make venv`): "
            + "; ".join(problems)
            + ' — or deselect them with -m "not integration"',
            pytrace=False,
        )


def _free_port() -> int:
    """A free port pair (API + events) that no other boot of this session was given: boots pick
    their ports here, one after the other, so servers starting at the same time never race for one."""
    while True:
        port = find_free_port(with_events=True)
        if not {port - 1, port, port + 1} & _ports:
            _ports.update((port, port + 1))
            return port


class Boot:
    """``server`` starting on a thread of its own; :meth:`get` waits for it (or fails the test).

    The constructor returns once vLLM is launched: until then the start reads this process's
    environment and module state, which the tests that run meanwhile may patch; only the wait for
    readiness runs beside them. :meth:`stop` stops the server whether it is up, still starting or
    failed to start. The start's duration goes to the integration timings as ``<name> server start``.
    """

    def __init__(self, name: str, server: Server) -> None:
        self.name, self.server = name, server
        if not server.port:
            server.port = _free_port()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, name=f"start {name} server", daemon=True)
        _boots.append(self)
        self._thread.start()
        while not server.running and self._thread.is_alive():
            time.sleep(0.01)

    def _start(self) -> None:
        started = time.monotonic()
        try:
            self.server.start()
        except BaseException as exc:  # reported by get(), in the test that needs the server
            self._error = exc
            return
        _timings[f"{self.name} server start"] = time.monotonic() - started

    def get(self) -> Server:
        self._thread.join()
        exc = self._error
        if exc is not None:
            what = str(exc) if isinstance(exc, ServerError | ModelError) else f"{type(exc).__name__}: {exc}"
            tail = getattr(exc, "log_tail", "")
            pytest.fail(f"{self.name} server did not start: {what}\n{tail}", pytrace=False)
        return self.server

    def stop(self) -> None:
        self.server.stop()  # a start still waiting for readiness gives up within half a second
        self._thread.join(timeout=30.0)
        self.server.stop()  # in case the start launched vLLM just after the first stop


def new_boot(name: str, log_dir: Path, **settings: Any) -> Boot:
    """Start a server with the session settings (``settings`` override them), logging to
    ``log_dir/<name>.log``."""
    settings = {**SERVER_SETTINGS, **settings}
    return Boot(name, Server(log_file=log_dir / f"{name}.log", startup_timeout=600.0, **settings))


def pytest_sessionfinish(session: pytest.Session) -> None:
    for boot in _boots:
        boot.stop()


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def selected_fixtures(request: pytest.FixtureRequest) -> frozenset[str]:
    """The names of the fixtures that the selected tests use, directly or through other fixtures."""
    return frozenset(name for item in request.session.items for name in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def session_boots(server_logs: Path, selected_fixtures: frozenset[str]) -> Iterator[dict[str, Boot]]:
    """The session servers (fixture name → boot) that the selected tests use, started together
    when the first test that uses one of them is set up (each start is mostly one core importing
    vLLM); stopped at the session's end."""
    require_serve_stack()
    boots = {
        fixture: new_boot(name, server_logs, **settings)
        for fixture, (name, settings) in SESSION_SERVERS.items()
        if fixture in selected_fixtures
    }
    try:
        yield boots
    finally:
        for started in boots.values():
            started.stop()


def _session_server(fixture: str, boots: dict[str, Boot], log_dir: Path) -> Server:
    if fixture not in boots:  # asked for by name while a test runs: no selected test names it
        name, settings = SESSION_SERVERS[fixture]
        boots[fixture] = new_boot(name, log_dir, **settings)
    return boots[fixture].get()


@pytest.fixture(scope="session")
def tokencake_server(session_boots: dict[str, Boot], server_logs: Path) -> Server:
    """The session's vLLM + TokenCake extension server (small device KV)."""
    return _session_server("tokencake_server", session_boots, server_logs)


@pytest.fixture(scope="session")
def baseline_server(session_boots: dict[str, Boot], server_logs: Path) -> Server:
    """Stock vLLM with the same settings and no extension."""
    return _session_server("baseline_server", session_boots, server_logs)


@pytest.fixture(scope="session")
def boot(server_logs: Path) -> Callable[..., Boot]:
    """``boot(name, **settings)`` starts a server with the session settings (``settings`` override
    them) on a thread of its own, logging to ``server_logs/<name>.log``; ``boot(name, server=srv)``
    starts ``srv`` as built. The caller stops it (``Boot.stop``); the session's end stops it too."""

    def start(name: str, server: Server | None = None, **settings: Any) -> Boot:
        require_serve_stack()
        if server is not None:
            if settings:
                raise TypeError("boot(name, server=...) takes no settings: the server has them")
            return Boot(name, server)
        return new_boot(name, server_logs, **settings)

    return start


@pytest.fixture
def timing() -> dict[str, float]:
    """Tests may record extra durations here; they are printed in the terminal summary."""
    return _timings


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _timings:
        terminalreporter.write_sep("-", "integration timings")
        for name, seconds in _timings.items():
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")
