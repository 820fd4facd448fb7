"""The spatial scheduler inside real vLLM-CPU: it loads through ``--scheduler-cls``, swaps vLLM's
waiting queue, admits annotated and plain requests side by side, and changes no answer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokencake.events import META_KEY
from tokencake.serving.server import SPATIAL_SCHEDULER, Server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def spatial_server(server_logs: Path) -> Iterator[Server]:
    """An extension server with the session's settings (conftest.py) plus the spatial scheduler."""
    srv = Server(
        num_gpu_blocks=40,
        max_model_len=4096,
        scheduler_cls=SPATIAL_SCHEDULER,
        log_file=server_logs / "tokencake-spatial.log",
        startup_timeout=600.0,
    )
    with srv:
        yield srv


def _chat(server: Server, text: str, meta: dict[str, Any] | None) -> str:
    body: dict[str, Any] = {
        "model": server.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0.0,
    }
    if meta is not None:
        body["kv_transfer_params"] = {META_KEY: meta}
    resp = httpx.post(server.base_url + "/chat/completions", json=body, timeout=300)
    resp.raise_for_status()
    return str(resp.json()["choices"][0]["message"]["content"])


def test_spatial_scheduler_serves_mixed_traffic_unchanged(
    spatial_server: Server, baseline_server: Server, timing: dict[str, float]
) -> None:
    log = spatial_server.log_path.read_text(errors="replace") if spatial_server.log_path else ""
    assert "spatial scheduler on" in log, "SpatialScheduler did not swap vLLM's waiting queue"
    prompts = [f"Request {i}: name a colour and a fruit. " + "word " * (40 * i) for i in range(8)]

    def meta(i: int) -> dict[str, Any] | None:
        if i % 2:  # every other request is a plain OpenAI request
            return None
        graph = {"on_critical_path": i == 0, "slack_s": float(i), "remaining_depth": i % 3}
        return {"session_id": f"sp:{i}", "run_id": "sp", "node": f"n{i}", "graph": graph}

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:  # all at once: more than fit run through the queue
        replies = list(pool.map(lambda i: _chat(spatial_server, prompts[i], meta(i)), range(8)))
    timing["spatial: 8 concurrent requests"] = time.monotonic() - started
    for i in (0, 1, 6, 7):  # annotated and plain, short and long: the same greedy answer alone
        assert _chat(baseline_server, prompts[i], None) == replies[i], i
