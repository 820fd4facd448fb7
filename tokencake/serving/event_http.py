"""The events listener's socket layer: a capped ``ThreadingHTTPServer`` and per-request deadlines.

Every connection holds one thread of EngineCore, so they are bounded (``max_connections``):

* at the cap, a new connection closes the one idle the longest (keep-alive, or still sending its
  request) — one that never presented the key first (an *untrusted* one), a trusted one only when
  every open connection is trusted. Keyless clients can therefore only push each other out, never
  the SDK's authenticated keep-alive connections;
* only when every connection is busy in a handler is the new one answered ``503`` at once.

A connection becomes trusted when one of its requests passed the key check (``trust``); without a
key, when it sent any authorized request. A request must arrive whole within ``request_timeout_s``
of its first byte (:class:`DeadlineReader`): a client sending one byte a second cannot hold a
thread for longer, whatever the per-read timeout.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tokencake.serving.stats import Stats

__all__ = ["BUSY_RESPONSE", "CappedHTTPServer", "CappedHTTPServer6", "DeadlineReader", "refuse"]

logger = logging.getLogger("tokencake.serving.event_api")


def _busy_response() -> bytes:
    body = json.dumps(
        {"ok": False, "status": "rejected", "reason": "unavailable", "detail": "too many connections"}
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


BUSY_RESPONSE = _busy_response()
#: How long the accept loop waits for shed connections' threads before answering 503.
_SHED_WAIT_S = 0.1


class CappedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with at most ``max_connections`` open connections (see module doc)."""

    daemon_threads = True
    allow_reuse_address = True
    # Keep-alive connections park handler threads in a read; closing must not wait for them.
    block_on_close = False
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler_cls: type[BaseHTTPRequestHandler],
        *,
        max_connections: int,
        metrics: Stats,
    ) -> None:
        self.max_connections = max_connections
        self.metrics = metrics
        self._conn_cond = threading.Condition()
        #: Open connections → busy (in a handler); least recently active first.
        self._conns: dict[socket.socket, bool] = {}
        #: Open connections that presented the key (shed only when no untrusted one is idle).
        self._trusted: set[socket.socket] = set()
        #: Connections closed to make room whose threads have not finished yet.
        self._shed: set[socket.socket] = set()
        super().__init__(address, handler_cls)

    @property
    def open_connections(self) -> int:
        with self._conn_cond:
            return len(self._conns) + len(self._shed)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._admit(request):
            self.metrics.inc("connections.refused")
            self.metrics.inc("http.503")
            refuse(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:  # no thread could be started: drop this one connection
            self._forget(request)
            self.metrics.inc("connections.thread_errors")
            self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanished mid-answer (or a connection shed to make room) is not news;
        # socketserver's default prints a traceback into vLLM's log.
        logger.debug("events connection from %s ended with an error", client_address, exc_info=True)

    def mark(self, request: socket.socket, busy: bool) -> None:
        """Record that ``request`` runs a handler (busy) or waits for its client (idle)."""
        with self._conn_cond:
            if request in self._conns:
                del self._conns[request]  # re-inserted last: most recently active
                self._conns[request] = busy

    def trust(self, request: socket.socket) -> None:
        """``request``'s client presented the key: shed it only when no untrusted one is idle."""
        with self._conn_cond:
            if request in self._conns:
                self._trusted.add(request)

    def _victim(self) -> socket.socket | None:
        """The connection to close for a new one: the longest-idle untrusted, else trusted one."""
        idle = [sock for sock, busy in self._conns.items() if not busy]
        return next((s for s in idle if s not in self._trusted), idle[0] if idle else None)

    def _admit(self, request: socket.socket) -> bool:
        deadline = time.monotonic() + _SHED_WAIT_S
        with self._conn_cond:
            while len(self._conns) >= self.max_connections:
                idle = self._victim()
                if idle is None:
                    return False
                if len(self._shed) < self.max_connections:
                    del self._conns[idle]
                    if idle in self._trusted:
                        self._trusted.discard(idle)
                        self.metrics.inc("connections.shed_trusted")
                    self._shed.add(idle)
                    with contextlib.suppress(OSError):
                        idle.shutdown(socket.SHUT_RDWR)  # its blocked read returns at once
                    self.metrics.inc("connections.shed")
                    continue
                # Too many shed connections still finishing: give their threads a moment.
                left = deadline - time.monotonic()
                if left <= 0 or not self._conn_cond.wait(left):
                    return False
            self._conns[request] = False
            return True

    def _forget(self, request: socket.socket) -> None:
        with self._conn_cond:
            self._conns.pop(request, None)
            self._trusted.discard(request)
            self._shed.discard(request)
            self._conn_cond.notify_all()


class CappedHTTPServer6(CappedHTTPServer):
    address_family = socket.AF_INET6


def refuse(sock: socket.socket) -> None:
    """Answer 503 without blocking the accept loop (best effort: the client may see a reset)."""
    try:
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.recv(64 * 1024)  # what already arrived: closing with unread data resets the answer
        sock.send(BUSY_RESPONSE)
    except OSError:
        pass


class DeadlineReader(io.RawIOBase):
    """A connection's socket as its handler reads it.

    Until a request's first byte every read may wait ``idle_s`` (a keep-alive pause); from that
    byte on, the whole request (line, headers, body) must arrive within ``limit_s``: a read past
    it raises ``TimeoutError`` (counted as ``connections.timed_out``). :meth:`next_request` starts
    over for the connection's next request. Writes keep the ``idle_s`` timeout.
    """

    def __init__(self, sock: socket.socket, idle_s: float, limit_s: float, metrics: Stats) -> None:
        super().__init__()
        self._sock = sock
        self._idle_s = idle_s
        self._limit_s = limit_s
        self._metrics = metrics
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def next_request(self) -> None:
        self.deadline = None

    def readinto(self, buffer: Any) -> int:
        if self.deadline is None:
            timeout = self._idle_s
        else:
            timeout = self.deadline - time.monotonic()
            if timeout <= 0:
                self._metrics.inc("connections.timed_out")
                raise TimeoutError(f"request not complete within {self._limit_s:g} s")
        self._sock.settimeout(timeout)
        try:
            n = self._sock.recv_into(buffer)
        except TimeoutError:
            if self.deadline is not None:
                self._metrics.inc("connections.timed_out")
            raise
        finally:
            with contextlib.suppress(OSError):  # a connection shed meanwhile may be closed
                self._sock.settimeout(self._idle_s)
        if n and self.deadline is None:
            self.deadline = time.monotonic() + self._limit_s
        return n
