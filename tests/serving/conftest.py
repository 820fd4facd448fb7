"""Shared fixtures of the serving tests: a CPU-only machine, a real vLLM start-up failure log,
and stand-in vLLM workers for the router tests."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tokencake.events import SESSION_HEADER
from tokencake.serving import machine


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only machine with native bf16 (no dtype override)."""
    monkeypatch.setattr(machine, "cuda_available", lambda: False)
    monkeypatch.setattr(machine, "vllm_installed", lambda: True)
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda cpuinfo=None: True)


# vLLM 0.32 log of `tokencake serve --num-gpu-blocks 24` (messages from vllm/v1/core/kv_cache_utils.py
# and vllm/v1/engine/utils.py; layout from vllm/logging_utils/formatter.py: continuation lines of a
# multi-line record are joined with "\r\n" + the prefix).
_E = "(EngineCore pid=4242) ERROR 12-01 10:00:03 [core.py:1510] "
KV_CAUSE = (
    "ValueError: To serve at least one request with the model's max seq len (4096), (0.09 GiB KV cache is "
    "needed, which is larger than the available KV cache memory (0.05 GiB). Based on the available memory, "
    "the estimated maximum model length is 2944. Try increasing `gpu_memory_utilization` (which also "
    "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. "
    "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)
KV_LOG = (
    "(APIServer pid=4200) INFO 12-01 10:00:00 [utils.py:286] non-default args: {'model': '/m'}\n"
    "(EngineCore pid=4242) INFO 12-01 10:00:02 [kv_cache_utils.py:2619] Overriding num_gpu_blocks=910 "
    "with num_gpu_blocks_override=24\n"
    + _E
    + "EngineCore failed to start.\r\n"
    + _E
    + "Traceback (most recent call last):\r\n"
    + _E
    + '  File "/v/vllm/v1/engine/core.py", line 1490, in run_engine_core\r\n'
    + _E
    + "    engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)\r\n"
    + _E
    + '  File "/v/vllm/v1/core/kv_cache_utils.py", line 1029, in _check_enough_kv_cache_memory\r\n'
    + _E
    + "    raise ValueError(\r\n"
    + _E
    + KV_CAUSE
    + "\n"
    "Process EngineCore:\n"
    "Traceback (most recent call last):\n"
    '  File "/usr/lib/python3.11/multiprocessing/process.py", line 314, in _bootstrap\n'
    "    self.run()\n"
    '  File "/v/vllm/v1/core/kv_cache_utils.py", line 1029, in _check_enough_kv_cache_memory\n'
    "    raise ValueError(\n" + KV_CAUSE + "\n"
    "(APIServer pid=4200) Traceback (most recent call last):\n"
    '(APIServer pid=4200)   File "<frozen runpy>", line 198, in _run_module_as_main\n'
    '(APIServer pid=4200)   File "/v/vllm/v1/engine/utils.py", line 1432, in wait_for_engine_startup\n'
    "(APIServer pid=4200)     raise RuntimeError(\n"
    "(APIServer pid=4200) RuntimeError: Engine core initialization failed. See root cause above. "
    "Failed core proc(s): {'EngineCore': 1}\n"
    "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: There appear to be 1 "
    "leaked shared_memory objects to clean up at shutdown\n"
    "  warnings.warn('resource_tracker: There appear to be %d '\n"
)


@pytest.fixture
def kv_log() -> tuple[str, str]:
    """``(log, cause)``: vLLM's log of a start that failed for lack of KV cache, and its root cause."""
    return KV_LOG, KV_CAUSE


# ------------------------------------------------------------------ stand-in workers (router tests)


class _StubHandler(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]]
    key: str | None
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server does

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, obj: dict[str, Any], status: int = 200) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _keyed(self) -> bool:
        """vLLM's rule: /v1 needs the key when there is one; /health never does."""
        if self.key is None or not self.path.startswith("/v1"):
            return True
        if self.headers.get("Authorization") == f"Bearer {self.key}":
            return True
        self._send({"error": "Unauthorized"}, 401)
        return False

    def do_GET(self) -> None:  # /health and /v1/models
        if self._keyed():
            self._send(
                {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "t"}]}
            )

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        if not self._keyed():
            return
        self.seen.append({"session": self.headers.get(SESSION_HEADER), "body": body})
        message = {"role": "assistant", "content": "ok"}
        choice = {"index": 0, "finish_reason": "stop", "message": message}
        self._send({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]})


class StubWorker:
    """A stand-in vLLM worker in this process: ``/health``, ``/v1/models``, chat completions
    (recorded in ``seen``), and vLLM's key rule when ``key`` is set."""

    def __init__(self, key: str | None = None) -> None:
        self.seen: list[dict[str, Any]] = []
        handler = type("Handler", (_StubHandler,), {"seen": self.seen, "key": key})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stub_worker() -> Iterator[Callable[..., StubWorker]]:
    """``stub_worker(key=None)`` starts a :class:`StubWorker`; all are stopped after the test."""
    made: list[StubWorker] = []

    def make(key: str | None = None) -> StubWorker:
        made.append(StubWorker(key))
        return made[-1]

    yield make
    for worker in made:
        worker.stop()
