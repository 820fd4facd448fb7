"""The HTTP endpoint that receives stall events: stdlib only, on a daemon thread, never raising.

It runs inside vLLM's EngineCore process (started by the scheduler-side connector), so it must be
small and harmless: a ``ThreadingHTTPServer`` on its own daemon thread, a body size limit, socket
timeouts, a deadline per request, and every handler error turned into a JSON 500 instead of an
exception. A 500 names no exception: its text stays in the log (it may quote internal state). The
handler (``handler(event) -> EventAck``) only does bookkeeping; block copies happen later on the
engine thread, so an ack never waits for an engine step.

Connections are capped and shed as ``event_http.py`` describes (idle and keyless ones first):
idle sockets can neither exhaust the threads of EngineCore nor lock legitimate clients out, and a
request must arrive whole within ``request_timeout_s`` of its first byte.

Routes: ``POST /v1/events`` (one event, see ``docs/events.md``), ``GET /v1/stats`` (JSON counters),
``GET /health``. With ``api_key`` set, events and stats need ``Authorization: Bearer <key>`` (the
scheme in any case, as vLLM accepts it); a refused request closes its connection. Without a key,
``/v1/stats`` (agent and tool names of every tenant) answers loopback clients only. The key reaches
EngineCore through the environment (:data:`EVENTS_API_KEY_ENV`), never argv.

``handler=None`` serves stats and health without taking events: ``/health`` then answers
``{"ok": true, "events": false}`` and events get 404, so that a client probing for a listener
(port + 1 of a router) learns to leave stall events to the servers (``tokencake serve --replicas``).
"""

from __future__ import annotations

import contextlib
import hmac
import io
import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from pydantic import ValidationError

from tokencake.events import (
    EVENTS_PATH,
    HEALTH_PATH,
    STATS_PATH,
    WIRE_VERSION,
    EventAck,
    StallBegin,
    StallEnd,
    parse_event,
)
from tokencake.serving.event_http import CappedHTTPServer, CappedHTTPServer6, DeadlineReader
from tokencake.serving.stats import Stats

__all__ = [
    "EVENTS_API_KEY_ENV",
    "HTTP_STATUS_BY_REASON",
    "EventHandler",
    "EventServer",
    "http_status",
    "is_loopback",
]

#: Environment variable that carries the events API key into vLLM's processes (``Server`` sets it
#: in the vLLM child's environment only; the connector reads it). Keeps the key out of argv/logs.
EVENTS_API_KEY_ENV = "TOKENCAKE_EVENTS_API_KEY"

logger = logging.getLogger(__name__)

EventHandler = Callable[[StallBegin | StallEnd], EventAck]

#: HTTP status of a rejected ack, by reason code; unknown reasons map to 400.
HTTP_STATUS_BY_REASON: dict[str, int] = {
    "invalid_event": 400,
    "unsupported_version": 400,
    "unauthorized": 401,
    "not_found": 404,
    "unknown_stall": 404,
    "method_not_allowed": 405,
    "end_before_begin": 409,
    "stall_conflict": 409,
    "session_mismatch": 409,
    "payload_too_large": 413,
    "internal_error": 500,
    "unavailable": 503,
}


def http_status(ack: EventAck) -> int:
    """200 for accepted acks (recorded/duplicate), else the reason's status (default 400)."""
    if ack.ok:
        return 200
    return HTTP_STATUS_BY_REASON.get(ack.reason or "", 400)


#: What a client learns about a server-side failure (the exception itself goes to the log).
INTERNAL_ERROR_DETAIL = "internal error; the server log has the details"
#: Why a listener without a handler (a router's status port) refuses events.
NO_EVENTS_DETAIL = (
    "no events listener here (a router in front of replicas): send stall_events=false and each "
    "replica derives its stalls from the requests"
)


def _reject(reason: str, detail: str) -> EventAck:
    return EventAck(ok=False, status="rejected", reason=reason, detail=detail)


def _validation_detail(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    more = len(exc.errors()) - 3
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (IPv4-mapped IPv6 included)."""
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


class EventServer:
    """Serve ``POST /v1/events``, ``GET /v1/stats``, ``GET /health`` on ``host:port`` (0: a free port)."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: EventHandler | None,
        stats_fn: Callable[[], dict[str, Any]] | None = None,
        api_key: str | None = None,
        *,
        max_body_bytes: int = 64 * 1024,
        socket_timeout_s: float = 30.0,
        request_timeout_s: float = 10.0,
        max_connections: int = 64,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        self.host = host
        self.requested_port = port
        self.handler = handler
        self.stats_fn = stats_fn
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.socket_timeout_s = socket_timeout_s
        #: Seconds from a request's first byte until it must have arrived whole.
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self.metrics = Stats(hist_window=2048)
        self._httpd: CappedHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------- lifecycle
    def start(self) -> EventServer:
        """Bind and serve on a daemon thread; raises ``OSError`` if the port cannot be bound."""
        with self._lock:
            if self._httpd is not None:
                return self
            request_handler = _make_request_handler(self)
            server_cls = CappedHTTPServer6 if ":" in self.host else CappedHTTPServer
            httpd = server_cls(
                (self.host, self.requested_port),
                request_handler,
                max_connections=self.max_connections,
                metrics=self.metrics,
            )
            self._httpd = httpd
            self._thread = threading.Thread(
                target=httpd.serve_forever,
                kwargs={"poll_interval": 0.2},
                name=f"tokencake-events:{self.port}",
                daemon=True,
            )
            self._thread.start()
            return self

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        with self._lock:
            httpd, thread = self._httpd, self._thread
            self._httpd = self._thread = None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> EventServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._httpd is not None

    @property
    def port(self) -> int:
        """The bound port (the actual one when started with port 0)."""
        httpd = self._httpd
        return int(httpd.server_address[1]) if httpd is not None else self.requested_port

    @property
    def open_connections(self) -> int:
        """Connections currently holding a thread (at most ``2 × max_connections``)."""
        httpd = self._httpd
        return httpd.open_connections if httpd is not None else 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # ----------------------------------------------------------------- logic
    @property
    def accepts_events(self) -> bool:
        """False for a stats-only listener (``handler=None``)."""
        return self.handler is not None

    def authorized(self, header: str | None) -> bool:
        """Constant-time check of ``Authorization: Bearer <api_key>`` (always true without a key).

        The scheme is case-insensitive (RFC 9110; vLLM's own check agrees)."""
        if self.api_key is None:
            return True
        scheme, _, token = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def stats_allowed(self, header: str | None, peer: str) -> bool:
        """``/v1/stats`` names every tenant's agents and tools: the key, or loopback without one."""
        if self.api_key is not None:
            return self.authorized(header)
        return is_loopback(peer)

    def handle_event_body(self, body: bytes) -> EventAck:
        """Parse, validate and dispatch one event body; never raises."""
        try:
            event = parse_event(body)
        except ValidationError as exc:
            return _reject("invalid_event", _validation_detail(exc))
        except ValueError as exc:  # pragma: no cover - pydantic wraps JSON errors, kept as a guard
            return _reject("invalid_event", str(exc)[:500])
        if event.v != WIRE_VERSION:
            return _reject(
                "unsupported_version", f"wire version {event.v}; this server speaks {WIRE_VERSION}"
            )
        if self.handler is None:
            return _reject("not_found", NO_EVENTS_DETAIL)
        self.metrics.inc(f"events.{event.type}")
        t0 = time.perf_counter()
        try:
            ack = self.handler(event)
            if not isinstance(ack, EventAck):
                ack = EventAck.model_validate(ack)
        except Exception as exc:
            self.metrics.inc("handler_errors")
            logger.exception("tokencake event handler failed on %s %s: %s", event.type, event.stall_id, exc)
            return _reject("internal_error", INTERNAL_ERROR_DETAIL)
        finally:
            self.metrics.observe("handler_s", time.perf_counter() - t0)
        return ack

    def stats_body(self) -> dict[str, Any]:
        """The ``/v1/stats`` document: ``stats_fn()`` plus this server's own counters under ``event_api``."""
        body: dict[str, Any] = {}
        if self.stats_fn is not None:
            produced = self.stats_fn()
            body = dict(produced) if isinstance(produced, dict) else {"stats": produced}
        body["event_api"] = self.metrics.snapshot()
        return body


def _make_request_handler(server: EventServer) -> type[BaseHTTPRequestHandler]:
    class _Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: one connection per client, lower latency
        server_version = "tokencake-events"
        sys_version = ""
        timeout = server.socket_timeout_s
        wbufsize = 64 * 1024  # one send per response (flushed by handle_one_request)

        def setup(self) -> None:
            super().setup()
            try:
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover - not a TCP socket
                pass
            self.rfile.close()  # the plain reader: replaced by one that keeps the request deadline
            self._reader = DeadlineReader(
                self.connection, server.socket_timeout_s, server.request_timeout_s, server.metrics
            )
            self.rfile = io.BufferedReader(self._reader)

        def handle_one_request(self) -> None:
            self._reader.next_request()
            super().handle_one_request()

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("events %s - " + format, self.address_string(), *args)

        def _send_json(self, status: int, payload: Any) -> None:
            data = json.dumps(payload, default=str).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()  # sent while still marked busy: an idle connection may be shed
            server.metrics.inc(f"http.{status}")

        @contextlib.contextmanager
        def _busy(self) -> Any:
            httpd: CappedHTTPServer = self.server  # type: ignore[assignment]
            httpd.mark(self.request, True)
            try:
                yield
            finally:
                httpd.mark(self.request, False)

        def _admitted(self, allowed: bool) -> bool:
            """After a key check: trust the connection, or answer 401 and close it."""
            if allowed:
                httpd: CappedHTTPServer = self.server  # type: ignore[assignment]
                httpd.trust(self.request)
                return True
            self.close_connection = True  # a refused client keeps no connection (and no thread)
            self._send_ack(_reject("unauthorized", "missing or wrong bearer token"))
            return False

        def _send_ack(self, ack: EventAck) -> None:
            self._send_json(http_status(ack), ack.model_dump(exclude_none=True))

        def do_GET(self) -> None:
            with self._busy():
                self._get()

        def _get(self) -> None:
            try:
                path = self.path.split("?", 1)[0]
                if path == HEALTH_PATH:
                    health = {"ok": True} if server.accepts_events else {"ok": True, "events": False}
                    self._send_json(200, health)
                elif path == STATS_PATH:
                    allowed = server.stats_allowed(self.headers.get("Authorization"), self.client_address[0])
                    if self._admitted(allowed):
                        self._send_json(200, server.stats_body())
                elif path == EVENTS_PATH:
                    self._send_ack(_reject("method_not_allowed", f"use POST {EVENTS_PATH}"))
                else:
                    self._send_ack(_reject("not_found", f"no route {path}"))
            except Exception as exc:
                self._internal_error(exc)

        def do_POST(self) -> None:
            try:
                path = self.path.split("?", 1)[0]
                if path != EVENTS_PATH:
                    self._discard_body()
                    self._send_ack(_reject("not_found", f"no route {path}"))
                    return
                allowed = server.authorized(self.headers.get("Authorization"))
                if not allowed:
                    self._discard_body()  # unread data would turn the 401 into a reset
                if not self._admitted(allowed):
                    return
                body = self._read_body()  # idle while the client sends: a slow body can be shed
                if body is None:
                    return
                with self._busy():
                    t0 = time.perf_counter()
                    ack = server.handle_event_body(body)
                    server.metrics.observe("event_s", time.perf_counter() - t0)
                    self._send_ack(ack)
            except Exception as exc:
                self._internal_error(exc)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """Methods other than GET/POST (501 from the stdlib) get the documented JSON 405."""
            if code != 501:
                super().send_error(code, message, explain)
                return
            self.close_connection = True  # the body (if any) is not read: do not reuse the connection
            if self.command == "HEAD":  # a HEAD answer has no body
                self.send_response(405)
                self.send_header("Content-Length", "0")
                self.send_header("Connection", "close")
                self.end_headers()
                server.metrics.inc("http.405")
                return
            self._send_ack(_reject("method_not_allowed", f"use GET or POST, not {self.command}"))

        def _read_body(self) -> bytes | None:
            length_header = self.headers.get("Content-Length")
            try:
                length = int(length_header) if length_header is not None else -1
            except ValueError:
                length = -1
            if length < 0:
                self.close_connection = True
                self._send_ack(_reject("invalid_event", "a Content-Length header is required"))
                return None
            if length > server.max_body_bytes:
                self.close_connection = True  # the unread body would corrupt the next request
                self._send_ack(
                    _reject("payload_too_large", f"{length} bytes > limit {server.max_body_bytes}")
                )
                return None
            body = self.rfile.read(length)
            if len(body) < length:  # the client went away (or the connection was shed)
                self.close_connection = True
                return None
            return body

        def _discard_body(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if 0 <= length <= server.max_body_bytes:
                self.rfile.read(length)
            else:
                self.close_connection = True

        def _internal_error(self, exc: Exception) -> None:
            if isinstance(exc, (ConnectionError, TimeoutError)):  # client gone or shed: no answer
                self.close_connection = True
                server.metrics.inc("connections.broken")
                return
            server.metrics.inc("internal_errors")
            logger.exception("tokencake events endpoint failed: %s", exc)
            self.close_connection = True
            try:
                self._send_ack(_reject("internal_error", INTERNAL_ERROR_DETAIL))
            except Exception:  # pragma: no cover - the client is gone
                pass

    return _Handler
