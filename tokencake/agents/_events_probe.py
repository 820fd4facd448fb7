"""Whether the events URL the SDK derived for a local server has an events listener behind it.

With a loopback base URL and no events URL named, ``tc.LLM`` and ``tc.Session`` send stall events
to port + 1 (the layout of ``tokencake serve``). Behind a router (``tokencake serve --replicas``)
that port is the supervisor's status listener, whose ``/health`` says ``"events": false`` — or
nothing listens there at all. Events sent there reach no replica, and requests that say
``stall_events: true`` keep the replicas from deriving the stalls themselves. So such a URL is
probed (``GET /health``, at most :data:`PROBE_TIMEOUT_S`) before the client's first request:
when no events listener answers, the client sends no events and its requests say
``stall_events: false``, with one ``RuntimeWarning`` per URL and process. An events URL named
explicitly elsewhere (another host or port) is taken as given.

A verdict is kept for :data:`RECHECK_S` per URL (a server started after the client is found on a
later check). The probe needs no key (``/health`` is open).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from urllib.parse import urlsplit

import httpx

from tokencake.events import HEALTH_PATH

__all__ = ["PROBE_TIMEOUT_S", "RECHECK_S", "is_derived_local", "missing_listener", "missing_listener_sync"]

log = logging.getLogger("tokencake.stall")

PROBE_TIMEOUT_S = 1.0
RECHECK_S = 60.0
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})

_lock = threading.Lock()
#: events URL → (monotonic time of the probe, why no listener answers or None).
_verdicts: dict[str, tuple[float, str | None]] = {}
_warned: set[str] = set()


def is_derived_local(events_url: str | None, derived: str | None) -> bool:
    """True for the events URL a loopback base URL gives by itself (``derived``): the one probed."""
    return events_url is not None and events_url == derived and urlsplit(events_url).hostname in _LOOPBACK


def _cached(url: str) -> tuple[bool, str | None]:
    with _lock:
        hit = _verdicts.get(url)
    if hit is not None and time.monotonic() - hit[0] < RECHECK_S:
        return True, hit[1]
    return False, None


def _verdict(response: httpx.Response) -> str | None:
    """None when an events listener answered; else why not."""
    if response.status_code != 200:
        return f"HTTP {response.status_code} on {HEALTH_PATH}"
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or body.get("ok") is not True:
        return "something else answers there"
    if body.get("events") is False:
        return "it is a router's status port (replicas behind a router take no stall events)"
    return None


def _remember(url: str, reason: str | None) -> str | None:
    with _lock:
        _verdicts[url] = (time.monotonic(), reason)
        first = reason is not None and url not in _warned
        if first:
            _warned.add(url)
    if first:
        message = (
            f"no TokenCake events listener at {url}: {reason}. Requests say stall_events=false, so "
            "the server derives each tool call's stall from them (docs/scale-out.md)"
        )
        log.info(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
    return reason


def _failed(exc: Exception) -> str:
    return f"nothing answers ({type(exc).__name__})"


async def missing_listener(url: str) -> str | None:
    """Why no events listener answers at ``url`` (None when one does); probed at most every
    :data:`RECHECK_S`."""
    known, reason = _cached(url)
    if known:
        return reason
    try:
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as client:
            reason = _verdict(await client.get(url + HEALTH_PATH))
    except httpx.HTTPError as exc:
        reason = _failed(exc)
    return _remember(url, reason)


def missing_listener_sync(url: str) -> str | None:
    """:func:`missing_listener` for synchronous callers (``Session.request_metadata``)."""
    known, reason = _cached(url)
    if known:
        return reason
    try:
        with httpx.Client(timeout=PROBE_TIMEOUT_S) as client:
            reason = _verdict(client.get(url + HEALTH_PATH))
    except httpx.HTTPError as exc:
        reason = _failed(exc)
    return _remember(url, reason)
