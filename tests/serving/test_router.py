"""The real vllm-router binary in front of two stand-in workers: what ``Replicas`` relies on.

A session's requests (``X-Session-ID``) all reach one worker, and the router forwards the TokenCake
fields (``kv_transfer_params``, ``priority``) untouched. No vLLM: the workers are small HTTP servers.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokencake.events import SESSION_HEADER
from tokencake.serving.replicas import Replicas


class _Worker(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]]
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server does

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, obj: dict[str, Any]) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # /health and /v1/models
        self._send(
            {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "t"}]}
        )

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        self.seen.append({"session": self.headers.get(SESSION_HEADER), "body": body})
        message = {"role": "assistant", "content": "ok"}
        choice = {"index": 0, "finish_reason": "stop", "message": message}
        self._send({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]})


class _Stub:
    """What ``Replicas`` needs of a replica to point the router at it."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        handler = type("Handler", (_Worker,), {"seen": self.seen})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.host, self.port = "127.0.0.1", self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[tuple[Replicas, list[_Stub]]]:
    reps = Replicas(2, log_dir=tmp_path)
    stubs = [_Stub(), _Stub()]
    reps.servers = stubs  # type: ignore[assignment]
    try:
        reps._start_router()
        yield reps, stubs
    finally:
        reps.stop()


def test_sessions_stick_to_a_worker_and_tokencake_fields_pass(routed: tuple[Replicas, list[_Stub]]) -> None:
    reps, stubs = routed
    # 32 sessions: with a balanced hash ring the chance that all land on one worker is 2**-31, so a
    # failure of the spread check below means the router sent everything to one worker.
    sessions = [f"app:agent-{i}" for i in range(32)]
    with httpx.Client(timeout=30.0) as client:
        for _turn in range(3):
            for sid in sessions:
                body = {
                    "model": "m",
                    "messages": [{"role": "user", "content": "hi"}],
                    "priority": 7,
                    "kv_transfer_params": {"tokencake": {"session_id": sid, "stall_events": False}},
                }
                resp = client.post(
                    reps.base_url + "/chat/completions", json=body, headers={SESSION_HEADER: sid}
                )
                assert resp.status_code == 200, resp.text
    where: dict[str, set[int]] = {}
    for i, stub in enumerate(stubs):
        for item in stub.seen:
            where.setdefault(item["session"], set()).add(i)
            assert item["body"]["priority"] == 7
            assert item["body"]["kv_transfer_params"]["tokencake"]["session_id"] == item["session"]
    assert sorted(where) == sorted(sessions)
    assert all(len(workers) == 1 for workers in where.values()), where  # every session stayed put
    log = (reps.log_dir / "router.log").read_text(errors="replace")[-3000:]
    spread = [len(stub.seen) for stub in stubs]
    assert all(spread), f"all sessions on one worker {spread}; router log tail:\n{log}"
