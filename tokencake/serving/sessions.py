"""Which KV blocks belong to which agent session, and the stall state machine fed by events.

Two inputs meet here:

* the engine thread reports each finished request of a session (``record_request``: the block
  hashes of prompt + output, from the connector's ``request_finished``);
* the events listener thread applies ``stall_begin`` / ``stall_end`` (``apply``), which validates,
  de-duplicates and acknowledges them *without waiting for the engine* (an idle engine does not
  step), and queues a :class:`StallTransition` that the engine thread picks up with ``drain``.

Ack codes follow ``docs/events.md``: duplicates answer ``200 duplicate``; an end whose begin was
never seen ``404 unknown_stall``; a begin arriving after its own end ``409 end_before_begin``; a
stall id reused by another session ``409 stall_conflict`` / ``session_mismatch``; a wire version
we do not speak ``400 unsupported_version``. Memory is bounded everywhere (LRU of sessions,
bounded finished-stall and orphan-end memories, capped active stalls).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tokencake.events import WIRE_VERSION, EventAck, StallBegin, StallEnd

__all__ = [
    "SessionBlocks",
    "SessionTracker",
    "StallRecord",
    "StallState",
    "StallTransition",
    "TransitionKind",
]

StallState = Literal["active", "ended", "expired", "rejected"]
TransitionKind = Literal["begin", "end", "expired"]


@dataclass(frozen=True)
class SessionBlocks:
    """The cached blocks of a session's latest finished request (prompt + output, full blocks only)."""

    session_id: str
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    request_id: str | None
    updated_at: float


@dataclass
class StallRecord:
    """One tool call of one session, as the server saw it (server-clock timestamps)."""

    stall_id: str
    session_id: str
    begin: StallBegin
    begin_at: float
    #: The session's blocks when the stall began (None: session unknown).
    blocks: SessionBlocks | None = None
    state: StallState = "active"
    end: StallEnd | None = None
    end_at: float | None = None
    #: The gate's reason code once decided (set by the engine side via ``set_decision``).
    decision: str | None = None
    expire_reason: str | None = None

    @property
    def agent_type(self) -> str:
        """The begin's agent type, falling back to the node name (as docs/events.md specifies)."""
        return self.begin.agent_type or self.begin.node


@dataclass(frozen=True)
class StallTransition:
    """A recorded change the engine thread must act on (offload, prefetch, release)."""

    kind: TransitionKind
    stall_id: str
    session_id: str
    at: float
    #: The event that caused it (None for an expiry decided by the tracker).
    event: StallBegin | StallEnd | None
    #: Snapshot of the session's blocks at stall begin.
    blocks: SessionBlocks | None = None
    detail: str | None = field(default=None)


def _ok(
    status: Literal["recorded", "duplicate"], decision: str | None = None, detail: str | None = None
) -> EventAck:
    return EventAck(ok=True, status=status, decision=decision, detail=detail)


def _reject(reason: str, detail: str) -> EventAck:
    return EventAck(ok=False, status="rejected", reason=reason, detail=detail)


class SessionTracker:
    """Thread-safe session → blocks map plus stall validation; see the module docstring."""

    def __init__(
        self,
        *,
        max_sessions: int = 4096,
        max_active_stalls: int = 4096,
        max_finished_stalls: int = 8192,
        max_orphan_ends: int = 1024,
        max_pending: int = 65536,
        max_stall_age_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min(max_sessions, max_active_stalls, max_finished_stalls, max_orphan_ends, max_pending) < 1:
            raise ValueError("SessionTracker bounds must be >= 1")
        self.max_sessions = max_sessions
        self.max_active_stalls = max_active_stalls
        self.max_finished_stalls = max_finished_stalls
        self.max_orphan_ends = max_orphan_ends
        self.max_stall_age_s = max_stall_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, SessionBlocks] = OrderedDict()
        self._active: OrderedDict[str, StallRecord] = OrderedDict()
        self._finished: OrderedDict[str, StallRecord] = OrderedDict()
        self._orphans: OrderedDict[str, str] = OrderedDict()  # stall_id -> session_id of a lone end
        self._pending: deque[StallTransition] = deque()
        self._max_pending = max_pending
        self._counts: dict[str, int] = {}

    # ------------------------------------------------------------- sessions
    def record_request(
        self,
        session_id: str,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        request_id: str | None = None,
    ) -> SessionBlocks:
        """Remember the blocks of the session's latest finished request (replaces the previous one)."""
        blocks = SessionBlocks(
            session_id=session_id,
            block_hashes=tuple(bytes(h) for h in block_hashes),
            num_tokens=max(int(num_tokens), 0),
            request_id=request_id,
            updated_at=self._clock(),
        )
        with self._lock:
            self._sessions[session_id] = blocks
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
                self._count("sessions_evicted")
            self._count("requests_recorded")
        return blocks

    def session(self, session_id: str) -> SessionBlocks | None:
        with self._lock:
            return self._sessions.get(session_id)

    def forget_session(self, session_id: str) -> bool:
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    # --------------------------------------------------------------- events
    def apply(self, event: StallBegin | StallEnd) -> EventAck:
        """Validate and record one event; never raises for well-typed events (see module doc)."""
        if event.v != WIRE_VERSION:
            self._count_locked("rejected.unsupported_version")
            return _reject(
                "unsupported_version", f"wire version {event.v}; this server speaks {WIRE_VERSION}"
            )
        with self._lock:
            if isinstance(event, StallBegin):
                ack = self._apply_begin(event)
            else:
                ack = self._apply_end(event)
            self._count(f"acks.{ack.status if ack.ok else ack.reason}")
            return ack

    def _apply_begin(self, ev: StallBegin) -> EventAck:
        now = self._clock()
        known = self._active.get(ev.stall_id) or self._finished.get(ev.stall_id)
        if known is not None:
            if known.session_id != ev.session_id:
                return _reject(
                    "stall_conflict",
                    f"stall_id {ev.stall_id!r} already belongs to session {known.session_id!r}",
                )
            if known.state == "rejected":  # answered end_before_begin before: answer it again
                return _reject("end_before_begin", f"stall {ev.stall_id!r} ended before its begin arrived")
            return _ok("duplicate", decision=known.decision)
        orphan_session = self._orphans.pop(ev.stall_id, None)
        if orphan_session is not None:
            # The end came first (reordered delivery): the tool is over, nothing to offload.
            rec = StallRecord(ev.stall_id, ev.session_id, ev, now, state="rejected")
            self._remember_finished(rec)
            return _reject("end_before_begin", f"stall {ev.stall_id!r} ended before its begin arrived")

        blocks = self._sessions.get(ev.session_id)
        if blocks is not None:
            self._sessions.move_to_end(ev.session_id)
        decision = None
        if blocks is None:
            decision = "unknown_session"
        elif not blocks.block_hashes:
            decision = "no_blocks"
        rec = StallRecord(ev.stall_id, ev.session_id, ev, now, blocks=blocks, decision=decision)
        self._active[ev.stall_id] = rec
        while len(self._active) > self.max_active_stalls:
            oldest = next(iter(self._active))
            self._expire(oldest, "too_many_active_stalls")
        self._push(StallTransition("begin", ev.stall_id, ev.session_id, now, ev, blocks))
        return _ok("recorded", decision=decision)

    def _apply_end(self, ev: StallEnd) -> EventAck:
        now = self._clock()
        rec = self._active.get(ev.stall_id)
        if rec is None:
            done = self._finished.get(ev.stall_id)
            if done is not None:
                if done.session_id != ev.session_id:
                    return _reject(
                        "session_mismatch",
                        f"stall {ev.stall_id!r} began in session {done.session_id!r}, not {ev.session_id!r}",
                    )
                if done.state == "expired" and done.end is None:
                    done.end, done.end_at = ev, now
                    return _ok("recorded", decision="expired", detail=f"stall expired ({done.expire_reason})")
                return _ok("duplicate", decision=done.decision)
            self._orphans[ev.stall_id] = ev.session_id
            while len(self._orphans) > self.max_orphan_ends:
                self._orphans.popitem(last=False)
            return _reject("unknown_stall", f"no stall_begin seen for stall {ev.stall_id!r}")
        if rec.session_id != ev.session_id:
            return _reject(
                "session_mismatch",
                f"stall {ev.stall_id!r} began in session {rec.session_id!r}, not {ev.session_id!r}",
            )
        del self._active[ev.stall_id]
        rec.state, rec.end, rec.end_at = "ended", ev, now
        self._remember_finished(rec)
        self._push(StallTransition("end", ev.stall_id, ev.session_id, now, ev, rec.blocks))
        return _ok("recorded", decision=rec.decision)

    # ------------------------------------------------------- engine-side API
    def drain(self, max_items: int | None = None) -> list[StallTransition]:
        """Pop queued transitions in arrival order (engine thread, e.g. in ``build_connector_meta``)."""
        with self._lock:
            n = len(self._pending) if max_items is None else min(max_items, len(self._pending))
            return [self._pending.popleft() for _ in range(n)]

    def set_decision(self, stall_id: str, decision: str) -> None:
        """Record the gate's reason code so later acks (duplicates) and stats can report it."""
        with self._lock:
            rec = self._active.get(stall_id) or self._finished.get(stall_id)
            if rec is not None:
                rec.decision = decision

    def stall(self, stall_id: str) -> StallRecord | None:
        """A copy of the stall's record (active or remembered finished), or None."""
        with self._lock:
            rec = self._active.get(stall_id) or self._finished.get(stall_id)
            return dataclasses.replace(rec) if rec is not None else None

    def active_stalls(self, session_id: str | None = None) -> list[StallRecord]:
        with self._lock:
            return [
                dataclasses.replace(r)
                for r in self._active.values()
                if session_id is None or r.session_id == session_id
            ]

    def expire(self, stall_id: str, reason: str = "expired") -> StallRecord | None:
        """End an active stall without a ``stall_end`` (called by the owner of the timing policy).

        No transition is queued: the caller already knows. A late ``stall_end`` then answers
        ``200 recorded`` with decision ``expired``.
        """
        with self._lock:
            rec = self._expire(stall_id, reason, notify=False)
            return dataclasses.replace(rec) if rec is not None else None

    def sweep(self, now: float | None = None) -> list[str]:
        """Safety net: expire active stalls older than ``max_stall_age_s``; queues ``expired`` transitions."""
        now = self._clock() if now is None else now
        with self._lock:
            old = [sid for sid, r in self._active.items() if now - r.begin_at >= self.max_stall_age_s]
            for sid in old:
                self._expire(sid, "max_stall_age")
            return old

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "sessions": len(self._sessions),
                "active_stalls": len(self._active),
                "finished_stalls": len(self._finished),
                "pending_transitions": len(self._pending),
                **dict(sorted(self._counts.items())),
            }

    # --------------------------------------------------------------- helpers
    def _expire(self, stall_id: str, reason: str, *, notify: bool = True) -> StallRecord | None:
        rec = self._active.pop(stall_id, None)
        if rec is None:
            return None
        rec.state, rec.expire_reason = "expired", reason
        self._remember_finished(rec)
        self._count(f"expired.{reason}")
        if notify:
            tr = StallTransition("expired", stall_id, rec.session_id, self._clock(), None, rec.blocks, reason)
            self._push(tr)
        return rec

    def _remember_finished(self, rec: StallRecord) -> None:
        self._finished[rec.stall_id] = rec
        self._finished.move_to_end(rec.stall_id)
        while len(self._finished) > self.max_finished_stalls:
            self._finished.popitem(last=False)

    def _push(self, tr: StallTransition) -> None:
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self._count("transitions_dropped")
        self._pending.append(tr)

    def _count(self, name: str, n: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + n

    def _count_locked(self, name: str) -> None:
        with self._lock:
            self._count(name)
