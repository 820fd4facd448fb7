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
            raise RuntimeError("boom: /srv/secret/path token=abc")
        return EventAck(ok=True, status="recorded")

    with EventServer("127.0.0.1", 0, flaky) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.post("/v1/events", json=BEGIN)
        assert r.status_code == 500
        assert r.json()["reason"] == "internal_error"
        # The exception's text may quote internal state: it goes to the log, never to the client.
        assert "boom" not in r.text and "secret" not in r.text and "RuntimeError" not in r.text
        assert c.post("/v1/events", json=BEGIN).status_code == 200
        assert c.get("/v1/stats").json()["event_api"]["counters"]["handler_errors"] == 1


def test_broken_stats_fn_is_500() -> None:
    def stats() -> dict[str, object]:
        raise ValueError("no stats")

    with EventServer("127.0.0.1", 0, lambda e: EventAck(ok=True, status="recorded"), stats) as srv:
        r = httpx.get(f"{srv.url}/v1/stats")
        assert r.status_code == 500
        assert "no stats" not in r.text and "ValueError" not in r.text
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


# ------------------------------------------------------------------ exposure and overload (issue 14)


def _process_threads() -> int:
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def test_busy_connections_over_the_cap_get_a_fast_503() -> None:
    entered = threading.Semaphore(0)
    release = threading.Event()

    def slow(event: StallBegin | StallEnd) -> EventAck:
        entered.release()
        release.wait(10)
        return EventAck(ok=True, status="recorded")

    statuses: list[int] = []
    with EventServer("127.0.0.1", 0, slow, max_connections=3) as srv:

        def post(k: int) -> None:
            r = httpx.post(f"{srv.url}/v1/events", json={**BEGIN, "stall_id": f"b{k}"}, timeout=10)
            statuses.append(r.status_code)

        busy = [threading.Thread(target=post, args=(k,)) for k in range(3)]
        for t in busy:
            t.start()
        for _ in busy:
            assert entered.acquire(timeout=5)
        t0 = time.perf_counter()
        try:
            r = httpx.get(f"{srv.url}/health", timeout=3)
            assert (r.status_code, r.json()["reason"]) == (503, "unavailable")
        except httpx.TransportError:
            pass  # refused before the request arrived: also acceptable, as long as it is fast
        assert time.perf_counter() - t0 < 1.0
        assert srv.metrics.snapshot()["counters"]["connections.refused"] >= 1
        release.set()
        for t in busy:
            t.join(10)
        assert statuses == [200, 200, 200]
        assert httpx.get(f"{srv.url}/health").status_code == 200  # serves again once they finish


def test_idle_connections_are_shed_and_threads_stay_bounded(tracker: SessionTracker) -> None:
    before = _process_threads()
    with EventServer("127.0.0.1", 0, tracker.apply, max_connections=4) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(40)]
        try:
            t0 = time.perf_counter()
            with httpx.Client(base_url=srv.url, timeout=5) as c:
                assert c.get("/health").status_code == 200
                assert c.post("/v1/events", json=BEGIN).status_code == 200
            assert time.perf_counter() - t0 < 2.0
            assert srv.open_connections <= 2 * 4
            assert _process_threads() - before <= 2 * 4
            counters = srv.metrics.snapshot()["counters"]
            assert counters["connections.shed"] >= 1
            # Shed (closed to make room) or, while too many shed threads were still finishing, 503.
            assert counters["connections.shed"] + counters.get("connections.refused", 0) >= 30
        finally:
            for sock in idle:
                sock.close()


def test_a_slow_body_is_idle_and_can_be_shed(tracker: SessionTracker) -> None:
    with EventServer("127.0.0.1", 0, tracker.apply, max_connections=1) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as slow:
            slow.sendall(b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{")
            time.sleep(0.2)  # the handler now waits for the rest of the body
            assert httpx.get(f"{srv.url}/health", timeout=3).status_code == 200
            assert slow.recv(4096) == b""  # shed: closed without an answer
        assert srv.metrics.snapshot()["counters"].get("internal_errors", 0) == 0


def test_stats_without_a_key_answer_loopback_only(tracker: SessionTracker) -> None:
    open_srv = EventServer("127.0.0.1", 0, tracker.apply)
    for peer in ("127.0.0.1", "127.0.0.9", "::1", "::ffff:127.0.0.1", "localhost"):
        assert open_srv.stats_allowed(None, peer), peer
    for peer in ("10.0.0.7", "192.168.1.2", "::ffff:10.0.0.7", "2001:db8::1", "not-an-ip"):
        assert not open_srv.stats_allowed(None, peer), peer
    keyed = EventServer("127.0.0.1", 0, tracker.apply, api_key="k")
    assert not keyed.stats_allowed(None, "127.0.0.1")  # with a key even loopback must present it
    assert keyed.stats_allowed("Bearer k", "10.0.0.7")


def test_hostile_bodies_get_no_5xx(client: httpx.Client) -> None:
    import random

    rng = random.Random(14)
    bodies: list[bytes] = [b"", b"null", b"[1]", b'{"type": 3}', b"\xff\xfe", b"{" * 5000]
    for i in range(300):
        doc: dict[str, object] = dict(rng.choice([BEGIN, END]))
        key = rng.choice([*doc.keys(), "extra"])
        doc[key] = rng.choice([None, -1, 1e308, "x" * rng.randint(0, 300), [], {}, True, f"s{i % 7}"])
        bodies.append(json.dumps(doc).encode())
        bodies.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))))
    seen = set()
    for body in bodies:
        r = client.post("/v1/events", content=body, headers={"Content-Type": "application/json"})
        seen.add(r.status_code)
    assert seen <= {200, 400, 404, 409}, seen


# ------------------------------------------------------------------ hostile clients (issue 49)


def _raw_post(sock: socket.socket, body: bytes, auth: str | None = None) -> bytes:
    """One keep-alive request on ``sock``; the raw answer (b"" when the server closed it)."""
    head = f"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
    if auth is not None:
        head += f"Authorization: {auth}\r\n"
    sock.sendall(head.encode() + b"\r\n" + body)
    try:
        return sock.recv(65536)
    except ConnectionError:
        return b""


@pytest.mark.parametrize("auth", ["bearer sekret", "BEARER sekret", "Bearer  sekret", "bEaReR sekret"])
def test_the_bearer_scheme_is_case_insensitive(tracker: SessionTracker, auth: str) -> None:
    with EventServer("127.0.0.1", 0, tracker.apply, api_key="sekret") as srv:
        r = httpx.post(f"{srv.url}/v1/events", json=BEGIN, headers={"Authorization": auth})
        assert r.status_code == 200
        assert httpx.get(f"{srv.url}/v1/stats", headers={"Authorization": auth}).status_code == 200
        for bad in ("Basic sekret", "sekret", "Bearer", "Bearersekret", "Bearer sekret2"):
            assert httpx.get(f"{srv.url}/v1/stats", headers={"Authorization": bad}).status_code == 401


def test_a_refused_request_closes_its_connection(tracker: SessionTracker) -> None:
    with EventServer("127.0.0.1", 0, tracker.apply, api_key="sekret") as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
            answer = _raw_post(sock, json.dumps(BEGIN).encode(), auth="Bearer wrong")
            assert answer.startswith(b"HTTP/1.1 401") and b"Connection: close" in answer
            assert sock.recv(4096) == b""  # closed: a keyless client holds no thread


def test_keyless_sockets_cannot_shed_an_authenticated_connection(tracker: SessionTracker) -> None:
    with EventServer("127.0.0.1", 0, tracker.apply, api_key="sekret", max_connections=4) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sdk:
            first = _raw_post(sdk, json.dumps(BEGIN).encode(), auth="Bearer sekret")
            assert first.startswith(b"HTTP/1.1 200")
            idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(30)]
            try:
                time.sleep(0.3)  # every one of them admitted (shedding another keyless one)
                again = _raw_post(sdk, json.dumps(END).encode(), auth="Bearer sekret")
                assert again.startswith(b"HTTP/1.1 200"), again  # the same connection still serves
                counters = srv.metrics.snapshot()["counters"]
                assert counters["connections.shed"] >= 20
                assert counters.get("connections.shed_trusted", 0) == 0
            finally:
                for sock in idle:
                    sock.close()


def test_a_slow_client_cannot_hold_a_thread_past_the_request_deadline(tracker: SessionTracker) -> None:
    with EventServer("127.0.0.1", 0, tracker.apply, request_timeout_s=1.0) as srv:
        request = b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n" + b" " * 40
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as slow:
            t0 = time.monotonic()
            closed_after = None
            for byte in request:  # one byte every 0.2 s: each read is quick, the request is not
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    closed_after = time.monotonic() - t0
                    break
                time.sleep(0.2)
                if srv.open_connections == 0:
                    closed_after = time.monotonic() - t0
                    break
        assert closed_after is not None and closed_after < 2.5, closed_after
        assert srv.metrics.snapshot()["counters"]["connections.timed_out"] == 1
        assert httpx.get(f"{srv.url}/health").status_code == 200
        # An idle keep-alive connection is not a slow request: it waits the per-read timeout.
        with httpx.Client(base_url=srv.url) as c:
            assert c.post("/v1/events", json=BEGIN).status_code == 200
            time.sleep(1.5)
            assert c.post("/v1/events", json=END).status_code == 200
        assert srv.metrics.snapshot()["counters"]["connections.timed_out"] == 1


def test_a_listener_without_a_handler_serves_stats_and_says_it_takes_no_events() -> None:
    with EventServer("127.0.0.1", 0, None, stats_fn=lambda: {"replicas": []}) as srv:
        assert httpx.get(f"{srv.url}/health").json() == {"ok": True, "events": False}
        r = httpx.post(f"{srv.url}/v1/events", json=BEGIN)
        assert (r.status_code, r.json()["reason"]) == (404, "not_found")
        assert "stall_events=false" in r.json()["detail"]
        assert httpx.get(f"{srv.url}/v1/stats").json()["replicas"] == []
