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
we do not speak ``400 unsupported_version``.

Memory is bounded in bytes, not only in counts. A session's block hashes are the big item (a
32-byte hash per block: a 128k-token context at 16 tokens per block holds ~600 KB of them), so
the hash tuples the tracker holds (latest blocks of each session, the snapshot of each active
stall; a tuple shared by both is counted once) stay under ``max_bytes``: least recently used
idle sessions go first, then, only if active stalls alone exceed it, the oldest active stalls
expire (``memory_budget``). Finished stall records keep no hashes (``num_blocks`` only) and no
begin ``stages``. :meth:`SessionTracker.sweep` is cheap (it only looks at what it removes) and
meant to be called about once a second; it also forgets sessions idle for ``session_ttl_s``.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from tokencake.events import WIRE_VERSION, EventAck, StallBegin, StallEnd

__all__ = [
    "BlockUsers",
    "ByteLRU",
    "SessionBlocks",
    "SessionTracker",
    "StallRecord",
    "StallState",
    "StallTransition",
    "TransitionKind",
    "hashes_nbytes",
]

StallState = Literal["active", "ended", "expired", "rejected"]
TransitionKind = Literal["begin", "end", "expired"]

#: Bytes a 32-byte hash costs in a tuple: the ``bytes`` object plus its tuple slot.
HASH_NBYTES = sys.getsizeof(b"\0" * 32) + 8


def hashes_nbytes(hashes: Sequence[bytes]) -> int:
    """Bytes a tuple of block hashes keeps alive (``sys.getsizeof`` of the tuple and its items)."""
    return sys.getsizeof(hashes) + sum(sys.getsizeof(h) for h in hashes)


class BlockUsers:
    """Block key -> the live stalls whose chain holds that block.

    Agents that share a system prompt share its blocks, so one session's idle chain can be the head
    of others'. The connector and the simulator keep one of these to leave a shared block out of
    a demotion while another stall should keep it longer (``_kept_by_another``)."""

    def __init__(self) -> None:
        self._users: dict[Hashable, set[str]] = {}

    def add(self, stall_id: str, keys: Sequence[Hashable]) -> None:
        for k in keys:
            self._users.setdefault(k, set()).add(stall_id)

    def remove(self, stall_id: str, keys: Sequence[Hashable]) -> None:
        for k in keys:
            users = self._users.get(k)
            if users is not None:
                users.discard(stall_id)
                if not users:
                    del self._users[k]

    def others(self, stall_id: str, key: Hashable) -> list[str]:
        """The other live stalls that hold ``key`` (usually none: an empty list, no allocation)."""
        users = self._users.get(key)
        if not users or (len(users) == 1 and stall_id in users):
            return []
        return [sid for sid in users if sid != stall_id]

    def __len__(self) -> int:
        return len(self._users)


@dataclass(frozen=True)
class SessionBlocks:
    """The cached blocks of a session's latest finished request (prompt + output, full blocks only)."""

    session_id: str
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    request_id: str | None
    updated_at: float
    #: Bytes the hash tuple keeps alive (see :func:`hashes_nbytes`).
    nbytes: int = 0


@dataclass
class StallRecord:
    """One tool call of one session, as the server saw it (server-clock timestamps)."""

    stall_id: str
    session_id: str
    #: The begin event, without its ``stages`` (the engine got them with the transition).
    begin: StallBegin
    begin_at: float
    #: The session's blocks when the stall began (None: session unknown). Dropped when the stall
    #: finishes, to bound memory; ``num_blocks`` stays.
    blocks: SessionBlocks | None = None
    #: How many blocks the session had at begin (None: session unknown).
    num_blocks: int | None = None
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
    #: Snapshot of the session's blocks at stall begin (``begin`` transitions only).
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
        max_bytes: int = 256 << 20,
        session_ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min(max_sessions, max_active_stalls, max_finished_stalls, max_orphan_ends, max_pending) < 1:
            raise ValueError("SessionTracker bounds must be >= 1")
        if max_bytes < 1024:
            raise ValueError(f"max_bytes must be >= 1024, got {max_bytes}")
        self.max_sessions = max_sessions
        self.max_active_stalls = max_active_stalls
        self.max_finished_stalls = max_finished_stalls
        self.max_orphan_ends = max_orphan_ends
        self.max_stall_age_s = max_stall_age_s
        #: Bound on the bytes of the block-hash tuples held (sessions and active stalls).
        self.max_bytes = max_bytes
        self.session_ttl_s = session_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        #: session id -> (latest blocks, last use), least recently used first.
        self._sessions: OrderedDict[str, tuple[SessionBlocks, float]] = OrderedDict()
        self._active: OrderedDict[str, StallRecord] = OrderedDict()  # begin order = age order
        #: The active stalls of sessions that sent no request here (nothing to offload), oldest
        #: first: the cap expires these before any stall of a real session.
        self._unknown: OrderedDict[str, None] = OrderedDict()
        self._finished: OrderedDict[str, StallRecord] = OrderedDict()
        self._orphans: OrderedDict[str, str] = OrderedDict()  # stall_id -> session_id of a lone end
        self._pending: deque[StallTransition] = deque()
        self._max_pending = max_pending
        #: id(SessionBlocks) -> [blocks, references from _sessions and active stalls].
        self._held: dict[int, list[Any]] = {}
        self._bytes = 0
        self._counts: dict[str, int] = {}

    # ------------------------------------------------------------- sessions
    def record_request(
        self,
        session_id: str,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        request_id: str | None = None,
    ) -> SessionBlocks:
        """Remember the blocks of the session's latest finished request (replaces the previous one).

        A chain too long for the whole budget keeps its head (a prefix is what a hit needs).
        """
        hashes = tuple(bytes(h) for h in block_hashes)
        nbytes = hashes_nbytes(hashes)
        if nbytes > self.max_bytes:
            keep = max(0, (self.max_bytes - sys.getsizeof(())) // HASH_NBYTES - 1)
            hashes = hashes[:keep]
            nbytes = hashes_nbytes(hashes)
            self._count_locked("sessions_truncated")
        now = self._clock()
        blocks = SessionBlocks(
            session_id=session_id,
            block_hashes=hashes,
            num_tokens=max(int(num_tokens), 0),
            request_id=request_id,
            updated_at=now,
            nbytes=nbytes,
        )
        with self._lock:
            self._drop_session(session_id)
            self._sessions[session_id] = (blocks, now)
            self._hold(blocks)
            while len(self._sessions) > self.max_sessions:
                self._drop_session(next(iter(self._sessions)))
                self._count("sessions_evicted")
            self._enforce_budget(keep=session_id)
            self._count("requests_recorded")
        return blocks

    def session(self, session_id: str) -> SessionBlocks | None:
        with self._lock:
            entry = self._sessions.get(session_id)
            return entry[0] if entry is not None else None

    def forget_session(self, session_id: str) -> bool:
        """Drop a session's blocks (O(1)); active stalls keep their own snapshot."""
        with self._lock:
            return self._drop_session(session_id)

    @property
    def retained_bytes(self) -> int:
        """Bytes of the block-hash tuples held now (each distinct tuple once)."""
        with self._lock:
            return self._bytes

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
        kept = ev.model_copy(update={"stages": None}) if ev.stages else ev
        orphan_session = self._orphans.pop(ev.stall_id, None)
        if orphan_session is not None:
            # The end came first (reordered delivery): the tool is over, nothing to offload.
            rec = StallRecord(ev.stall_id, ev.session_id, kept, now, state="rejected")
            self._remember_finished(rec)
            return _reject("end_before_begin", f"stall {ev.stall_id!r} ended before its begin arrived")

        entry = self._sessions.get(ev.session_id)
        blocks = None
        if entry is not None:
            blocks = entry[0]
            self._sessions[ev.session_id] = (blocks, now)
            self._sessions.move_to_end(ev.session_id)
        decision = None
        if blocks is None:
            decision = "unknown_session"
        elif not blocks.block_hashes:
            decision = "no_blocks"
        num_blocks = len(blocks.block_hashes) if blocks is not None else None
        rec = StallRecord(ev.stall_id, ev.session_id, kept, now, blocks, num_blocks, decision=decision)
        self._active[ev.stall_id] = rec
        if blocks is not None:
            self._hold(blocks)
        else:
            self._unknown[ev.stall_id] = None
        while len(self._active) > self.max_active_stalls:
            # Begins for made-up sessions (a buggy or hostile client) must not push out the
            # stalls of sessions whose KV is actually held: those go only when nothing else can.
            oldest = next(iter(self._unknown)) if self._unknown else next(iter(self._active))
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
        self._unknown.pop(ev.stall_id, None)
        rec.state, rec.end, rec.end_at = "ended", ev, now
        self._remember_finished(rec)
        self._push(StallTransition("end", ev.stall_id, ev.session_id, now, ev))
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
        """Periodic safety net; cheap (it looks only at what it removes), call about once a second.

        Expires active stalls older than ``max_stall_age_s`` (queues ``expired`` transitions) and
        forgets sessions idle for ``session_ttl_s``. Returns the expired stall ids.
        """
        now = self._clock() if now is None else now
        with self._lock:
            old = []
            for sid, rec in self._active.items():  # oldest first: stop at the first young one
                if now - rec.begin_at < self.max_stall_age_s:
                    break
                old.append(sid)
            for sid in old:
                self._expire(sid, "max_stall_age")
            while self._sessions:
                sid, (_blocks, used_at) = next(iter(self._sessions.items()))
                if now - used_at < self.session_ttl_s:
                    break
                self._drop_session(sid)
                self._count("sessions_idle_forgotten")
            return old

    def pending_transitions(self) -> int:
        """Transitions applied but not yet drained: cheap (the engine asks every step)."""
        with self._lock:
            return len(self._pending)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "sessions": len(self._sessions),
                "active_stalls": len(self._active),
                "finished_stalls": len(self._finished),
                "pending_transitions": len(self._pending),
                "retained_bytes": self._bytes,
                "max_bytes": self.max_bytes,
                **dict(sorted(self._counts.items())),
            }

    # --------------------------------------------------------------- helpers
    def _hold(self, blocks: SessionBlocks) -> None:
        ref = self._held.get(id(blocks))
        if ref is None:
            self._held[id(blocks)] = [blocks, 1]
            self._bytes += blocks.nbytes
        else:
            ref[1] += 1

    def _unhold(self, blocks: SessionBlocks) -> None:
        ref = self._held.get(id(blocks))
        if ref is None:
            return
        ref[1] -= 1
        if ref[1] <= 0:
            del self._held[id(blocks)]
            self._bytes -= blocks.nbytes

    def _drop_session(self, session_id: str) -> bool:
        entry = self._sessions.pop(session_id, None)
        if entry is None:
            return False
        self._unhold(entry[0])
        return True

    def _enforce_budget(self, keep: str) -> None:
        """Evict idle sessions (LRU first), then expire the oldest active stalls, until under
        budget. Session ``keep`` (just recorded, at most ``max_bytes`` itself) stays."""
        while self._bytes > self.max_bytes:
            for sid in list(self._sessions):
                if self._bytes <= self.max_bytes:
                    return
                if sid == keep or self._held[id(self._sessions[sid][0])][1] > 1:
                    continue  # an active stall holds the same tuple: dropping the entry frees nothing
                self._drop_session(sid)
                self._count("sessions_evicted_bytes")
            if self._bytes <= self.max_bytes or not self._active:
                return
            self._expire(next(iter(self._active)), "memory_budget")

    def _expire(self, stall_id: str, reason: str, *, notify: bool = True) -> StallRecord | None:
        rec = self._active.pop(stall_id, None)
        if rec is None:
            return None
        self._unknown.pop(stall_id, None)
        rec.state, rec.expire_reason = "expired", reason
        self._remember_finished(rec)
        self._count(f"expired.{reason}")
        if notify:
            tr = StallTransition("expired", stall_id, rec.session_id, self._clock(), None, None, reason)
            self._push(tr)
        return rec

    def _remember_finished(self, rec: StallRecord) -> None:
        if rec.blocks is not None:  # a finished stall needs no hashes: free them
            self._unhold(rec.blocks)
            rec.blocks = None
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


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """An LRU map bounded by entry count *and* by the bytes its values keep alive.

    For the engine thread's per-session memories (e.g. the last stall of each session, which
    carries the chain's hashes): ``put(key, value, nbytes)`` evicts least recently used entries
    until both bounds hold. Not thread-safe (single owner).
    """

    def __init__(
        self, max_items: int, max_bytes: int, on_evict: Callable[[K, V], None] | None = None
    ) -> None:
        """``on_evict(key, value)``: called for each entry the bounds push out (not on ``pop``)."""
        if max_items < 1 or max_bytes < 1:
            raise ValueError("ByteLRU bounds must be >= 1")
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.nbytes = 0
        self.evicted = 0
        self._on_evict = on_evict

    def put(self, key: K, value: V, nbytes: int) -> None:
        self.pop(key)
        self._items[key] = (value, nbytes)
        self.nbytes += nbytes
        while len(self._items) > 1 and (len(self._items) > self.max_items or self.nbytes > self.max_bytes):
            k, (v, n) = self._items.popitem(last=False)
            self.nbytes -= n
            self.evicted += 1
            if self._on_evict is not None:
                self._on_evict(k, v)

    def get(self, key: K) -> V | None:
        entry = self._items.get(key)
        return entry[0] if entry is not None else None

    def pop(self, key: K) -> V | None:
        entry = self._items.pop(key, None)
        if entry is None:
            return None
        self.nbytes -= entry[1]
        return entry[0]

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def items(self) -> list[tuple[K, V]]:
        """A snapshot of (key, value), least recently used first."""
        return [(k, v) for k, (v, _n) in self._items.items()]
