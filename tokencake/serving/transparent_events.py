"""Transparent mode's settings and its stall events (``transparent_asgi.py`` is the middleware).

The settings reach vLLM's API server process in its environment (``ServerConfig.child_env``):
:data:`EVENTS_URL_ENV` turns the mode on, the events key is the listener's own
(``TOKENCAKE_EVENTS_API_KEY``), :data:`MAX_CONVERSATIONS_ENV` bounds the conversation table.

Events go to the listener in EngineCore like the SDK's (``POST {events_url}/v1/events``), with
``node`` / ``agent_type`` :data:`~tokencake.serving.transparent.TRANSPARENT_NODE`; delivery
never raises: a listener that fails is logged once and counted.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from tokencake.events import EVENTS_PATH, EventAck, StallBegin, StallEnd
from tokencake.serving.event_api import EVENTS_API_KEY_ENV
from tokencake.serving.transparent import TRANSPARENT_NODE, Conversation, OpenCall

__all__ = [
    "EVENTS_URL_ENV",
    "MAX_CONVERSATIONS_ENV",
    "EventPoster",
    "TransparentConfig",
    "begin_event",
    "end_event",
]

log = logging.getLogger("tokencake.serving.transparent")

#: The events listener's root URL (set: transparent mode on).
EVENTS_URL_ENV = "TOKENCAKE_TRANSPARENT_EVENTS_URL"
#: How many conversations one API server process remembers (default 4096).
MAX_CONVERSATIONS_ENV = "TOKENCAKE_TRANSPARENT_MAX_CONVERSATIONS"


@dataclass(frozen=True)
class TransparentConfig:
    """Transparent mode's settings (``events_url`` None: off, every request passes through)."""

    events_url: str | None
    events_api_key: str | None = None
    max_conversations: int = 4096
    #: Larger request bodies (and JSON replies) are passed through unread.
    max_body_bytes: int = 8 << 20
    #: The longest a request waits for the listener (its ends), and each event's HTTP timeout.
    timeout_s: float = 1.0
    #: After an event timed out, further begins are dropped for this long.
    cooldown_s: float = 30.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TransparentConfig:
        env = os.environ if env is None else env
        raw = env.get(MAX_CONVERSATIONS_ENV) or "4096"
        try:
            count = max(1, int(raw))
        except ValueError:
            log.warning("transparent mode: %s=%r is not a number; keeping 4096", MAX_CONVERSATIONS_ENV, raw)
            count = 4096
        return cls(
            events_url=(env.get(EVENTS_URL_ENV) or "").rstrip("/") or None,
            events_api_key=env.get(EVENTS_API_KEY_ENV) or None,
            max_conversations=count,
        )


class EventPoster:
    """Posts stall events to the events listener; never raises. A listener that fails is logged
    once and counted; after a timeout, begins are dropped for ``cooldown_s`` (an end whose begin
    was delivered is always tried)."""

    def __init__(self, config: TransparentConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        assert config.events_url is not None
        self.url = config.events_url + EVENTS_PATH
        self.config = config
        self.transport = transport
        self.counts: dict[str, int] = {}
        self._client: httpx.AsyncClient | None = None
        self._quiet_until = 0.0
        self._warned = False

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            key = self.config.events_api_key
            self._client = httpx.AsyncClient(
                timeout=self.config.timeout_s,
                headers={"Authorization": f"Bearer {key}"} if key else {},
                transport=self.transport,
                trust_env=False,  # a loopback listener: never through a proxy
            )
        return self._client

    async def post(self, event: StallBegin | StallEnd, *, owed: bool = False) -> bool:
        """Send one event; True when the listener recorded it (or had it already)."""
        if not owed and time.monotonic() < self._quiet_until:
            self._count("skipped")
            return False
        try:
            response = await self._http().post(self.url, json=event.model_dump(mode="json"))
        except httpx.TimeoutException as exc:
            self._quiet_until = time.monotonic() + self.config.cooldown_s
            self._fail(f"timeout ({type(exc).__name__})")
            return False
        except httpx.HTTPError as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
            return False
        try:
            ack = EventAck.model_validate_json(response.content)
        except ValueError:
            self._fail(f"HTTP {response.status_code} without an ack")
            return False
        if response.status_code == 200 and ack.ok:
            self._count(f"sent.{event.type}")
            return True
        self._count("rejected")
        self._warn(f"{event.type} {event.stall_id} rejected: {ack.reason} {ack.detail or ''}")
        return False

    def _fail(self, why: str) -> None:
        self._count("failed")
        self._warn(f"not delivered ({why})")

    def _warn(self, message: str) -> None:
        log.debug("transparent mode: stall event to %s %s", self.url, message)
        if not self._warned:
            self._warned = True
            log.warning(
                "transparent mode: stall event to %s %s; requests are served without it (logged once)",
                self.url,
                message,
            )

    def _count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1


def begin_event(conv: Conversation, call: OpenCall) -> StallBegin:
    """The ``stall_begin`` of one tool call of ``conv``."""
    return StallBegin(
        stall_id=call.stall_id,
        session_id=conv.session_id,
        run_id=conv.run_id,
        node=TRANSPARENT_NODE,
        agent_type=TRANSPARENT_NODE,
        tool=call.tool,
        ts=time.time(),
    )


def end_event(conv: Conversation, call: OpenCall, now: float) -> StallEnd:
    """The ``stall_end`` of one tool call of ``conv`` (``now``: monotonic, as ``begun_at``)."""
    return StallEnd(
        stall_id=call.stall_id,
        session_id=conv.session_id,
        run_id=conv.run_id,
        node=TRANSPARENT_NODE,
        tool=call.tool,
        duration_s=max(now - call.begun_at, 0.0),
        ts=time.time(),
    )
