from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tokencake.events import EventAck, StallBegin, StallEnd
from tokencake.serving.event_api import EventServer, http_status
from tokencake.serving.sessions import SessionTracker

BEGIN = {
    "type": "stall_begin",
    "stall_id": "st-1",
    "session_id": "run:a",
    "run_id": "run",
    "node": "a",
    "tool": "search",
    "predicted_s": 2.0,
    "ts": 1.0,
}
END = {
    "type": "stall_end",
    "stall_id": "st-1",
    "session_id": "run:a",
    "run_id": "run",
    "node": "a",
    "tool": "search",
    "duration_s": 1.5,
    "ts": 2.5,
}


@pytest.fixture
def tracker() -> SessionTracker:
    t = SessionTracker()
    t.record_request("run:a", [b"\x01" * 32], 200)
    return t


@pytest.fixture
def server(tracker: SessionTracker) -> Iterator[EventServer]:
    srv = EventServer("127.0.0.1", 0, tracker.apply, stats_fn=lambda: {"sessions": tracker.stats()})
    with srv:
        yield srv


@pytest.fixture
def client(server: EventServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=5.0) as c:
        yield c


def test_port_zero_reports_real_port(server: EventServer) -> None:
    assert server.running
    assert server.port != 0
    assert server.url == f"http://127.0.0.1:{server.port}"


def test_health(client: httpx.Client) -> None:
    r = client.get("/health")
    assert (r.status_code, r.json()) == (200, {"ok": True})


def test_begin_end_duplicate_unknown(client: httpx.Client, tracker: SessionTracker) -> None:
    r = client.post("/v1/events", json=BEGIN)
    assert r.status_code == 200
    assert r.json() == {"ok": True, "status": "recorded"}
    r = client.post("/v1/events", json=BEGIN)
    assert (r.status_code, r.json()["status"]) == (200, "duplicate")
    assert client.post("/v1/events", json=END).json()["status"] == "recorded"
    r = client.post("/v1/events", json={**END, "stall_id": "ghost"})
    assert r.status_code == 404
    assert r.json()["reason"] == "unknown_stall"
    r = client.post("/v1/events", json={**BEGIN, "stall_id": "ghost"})
    assert (r.status_code, r.json()["reason"]) == (409, "end_before_begin")
    assert [tr.kind for tr in tracker.drain()] == ["begin", "end"]


def test_unknown_session_decision(client: httpx.Client) -> None:
    r = client.post("/v1/events", json={**BEGIN, "session_id": "run:zzz"})
    assert r.status_code == 200
    assert r.json()["decision"] == "unknown_session"


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[]",
        json.dumps({**BEGIN, "type": "stall_middle"}).encode(),
        json.dumps({k: v for k, v in BEGIN.items() if k != "stall_id"}).encode(),
        json.dumps({**BEGIN, "predicted_s": -1}).encode(),
    ],
)
def test_invalid_events_are_400(client: httpx.Client, body: bytes) -> None:
    r = client.post("/v1/events", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    payload = r.json()
    assert (payload["ok"], payload["status"], payload["reason"]) == (False, "rejected", "invalid_event")
    assert payload["detail"]


def test_unsupported_version(client: httpx.Client) -> None:
    r = client.post("/v1/events", json={**BEGIN, "v": 99})
    assert (r.status_code, r.json()["reason"]) == (400, "unsupported_version")


def test_body_size_limit(tracker: SessionTracker) -> None:
    with EventServer("127.0.0.1", 0, tracker.apply, max_body_bytes=200) as srv:
        r = httpx.post(f"{srv.url}/v1/events", json={**BEGIN, "node": "x" * 190})
        assert (r.status_code, r.json()["reason"]) == (413, "payload_too_large")
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_unknown_routes_and_methods(client: httpx.Client) -> None:
    assert client.get("/nope").status_code == 404
    assert client.post("/nope", json={}).status_code == 404
    assert client.get("/v1/events").status_code == 405


def test_stats_endpoint(client: httpx.Client) -> None:
    client.post("/v1/events", json=BEGIN)
    stats = client.get("/v1/stats").json()
    assert stats["sessions"]["active_stalls"] == 1
    assert stats["event_api"]["counters"]["events.stall_begin"] == 1
    assert stats["event_api"]["counters"]["http.200"] >= 1


def test_handler_exception_is_500_and_server_survives() -> None:
    calls = {"n": 0}

    def flaky(event: StallBegin | StallEnd) -> EventAck:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return EventAck(ok=True, status="recorded")

    with EventServer("127.0.0.1", 0, flaky) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.post("/v1/events", json=BEGIN)
        assert r.status_code == 500
        assert r.json()["reason"] == "internal_error"
        assert "boom" in r.json()["detail"]
        assert c.post("/v1/events", json=BEGIN).status_code == 200
        assert c.get("/v1/stats").json()["event_api"]["counters"]["handler_errors"] == 1


def test_broken_stats_fn_is_500() -> None:
    def stats() -> dict[str, object]:
        raise ValueError("no stats")

    with EventServer("127.0.0.1", 0, lambda e: EventAck(ok=True, status="recorded"), stats) as srv:
        r = httpx.get(f"{srv.url}/v1/stats")
        assert r.status_code == 500
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_api_key(tracker: SessionTracker) -> None:
    with EventServer("127.0.0.1", 0, tracker.apply, api_key="sekret") as srv:
        url = f"{srv.url}/v1/events"
        r = httpx.post(url, json=BEGIN)
        assert (r.status_code, r.json()["reason"]) == (401, "unauthorized")
        assert httpx.post(url, json=BEGIN, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{srv.url}/v1/stats").status_code == 401
        assert httpx.get(f"{srv.url}/health").status_code == 200  # liveness needs no key
        ok = httpx.post(url, json=BEGIN, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert httpx.get(f"{srv.url}/v1/stats", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_missing_content_length() -> None:
    with EventServer("127.0.0.1", 0, lambda e: EventAck(ok=True, status="recorded")) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/events HTTP/1.1\r\nHost: x\r\n\r\n")
            data = sock.recv(4096).decode()
        assert data.startswith("HTTP/1.1 400")
        assert "Content-Length" in data


def test_keep_alive_and_concurrency(tracker: SessionTracker, server: EventServer) -> None:
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            with httpx.Client(base_url=server.url, timeout=5.0) as c:
                for i in range(25):
                    sid = f"w{k}-{i}"
                    assert c.post("/v1/events", json={**BEGIN, "stall_id": sid}).status_code == 200
                    assert c.post("/v1/events", json={**END, "stall_id": sid}).status_code == 200
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(tracker.drain()) == 200


def test_close_frees_port_even_with_open_connection(tracker: SessionTracker) -> None:
    srv = EventServer("127.0.0.1", 0, tracker.apply).start()
    port = srv.port
    c = httpx.Client(base_url=srv.url)
    assert c.get("/health").status_code == 200  # leaves a keep-alive connection open
    t0 = time.perf_counter()
    srv.close()
    srv.close()  # idempotent
    assert time.perf_counter() - t0 < 3.0
    assert not srv.running
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
    c.close()
    # the port can be bound again right away
    with EventServer("127.0.0.1", port, tracker.apply) as again:
        assert again.port == port


def test_http_status_mapping() -> None:
    assert http_status(EventAck(ok=True, status="duplicate")) == 200
    assert http_status(EventAck(ok=False, status="rejected", reason="stall_conflict")) == 409
    assert http_status(EventAck(ok=False, status="rejected", reason="something_new")) == 400
