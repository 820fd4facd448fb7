"""The stalls the core tracks: active ones (by stall, session and tool call), ended ones until their next
turn is accounted, derived ones for clients that send no events, and at-finish pins.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tokencake.events import StallBegin, StallEnd
from tokencake.serving.kvcore.records import CRITICAL_SESSIONS, ReqInfo, Stall, finish_owner, stall_owner
from tokencake.serving.prefetch import stall_expiry_s
from tokencake.serving.sessions import BlockUsers, ByteLRU
from tokencake.serving.stall_calls import ToolCall

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

log = logging.getLogger("vllm.tokencake")


class StallBook:
    """The stalls the core tracks (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core
        self.active: dict[str, Stall] = {}
        #: Block hash -> the live stalls whose chain holds it (a shared prompt: several).
        self.users = BlockUsers()
        self.ended: dict[str, Stall] = {}
        #: Last ended/expired stall per session (to account the session's next request).
        self.last: ByteLRU[str, Stall] = ByteLRU(max_items=4096, max_bytes=64 << 20)
        self.next_sweep = 0.0
        #: session id -> its active stall's id (the one its concurrent tool calls share).
        self.by_session: dict[str, str] = {}
        #: Open tool call (its ``stall_begin`` id) -> the active stall it shares.
        self.by_call: dict[str, str] = {}
        #: Sessions whose client sends no stall events and whose last request began a derived stall.
        self.derived: ByteLRU[str, bool] = ByteLRU(max_items=4096, max_bytes=1 << 20)
        #: Sessions whose at-finish save committed before their stall began: their host copies are
        #: pinned (owner ``finish:<session>``) until the stall pins them, or this deadline.
        self.finish_pins: dict[str, float] = {}
        #: Session → its latest at-finish decision, until its stall begins (``Stall.finish_decision``).
        self.finish_decision: ByteLRU[str, str] = ByteLRU(max_items=CRITICAL_SESSIONS, max_bytes=1 << 20)

    def get(self, stall_id: str) -> Stall | None:
        return self.active.get(stall_id) or self.ended.get(stall_id)

    def active_of(self, session_id: str | None) -> Stall | None:
        sid = self.by_session.get(session_id or "")
        return self.active.get(sid) if sid is not None else None

    def add(self, stall: Stall) -> None:
        self.active[stall.stall_id] = stall
        self.users.add(stall.stall_id, stall.hashes)
        self.by_session[stall.session_id] = stall.stall_id
        self.by_call[stall.stall_id] = stall.stall_id

    def pop(self, stall: Stall) -> None:
        """The stall is no longer active (its last call ended or expired): unmap it."""
        if self.active.pop(stall.stall_id, None) is not None:
            self.users.remove(stall.stall_id, stall.hashes)
        if self.by_session.get(stall.session_id) == stall.stall_id:
            del self.by_session[stall.session_id]
        for call_id in stall.calls.open:
            self.by_call.pop(call_id, None)

    def of_call(self, call_id: str) -> Stall | None:
        """The active stall an open tool call shares, or None."""
        sid = self.by_call.get(call_id)
        return self.active.get(sid) if sid is not None else None

    def leave(self, stall: Stall, call_id: str) -> ToolCall | None:
        """Take an open call out of its stall (it ended or expired)."""
        self.by_call.pop(call_id, None)
        return stall.calls.leave(call_id)

    def release(self, stall_id: str) -> None:
        """Unpin a stall's host copies and forget it (a prefetch in flight keeps its own pins)."""
        self.core.host.release(stall_owner(stall_id))
        self.ended.pop(stall_id, None)
        self.core.eviction.demoted.pop(stall_id, None)

    def release_finish_pins(self, session_id: str) -> None:
        if self.finish_pins.pop(session_id, None) is not None:
            self.core.host.release(finish_owner(session_id))

    def expiry(self, predicted_s: float) -> float:
        """How long a stall predicted to last ``predicted_s`` may go without its end."""
        o = self.core.opts
        return stall_expiry_s(predicted_s, factor=o.expiry_factor, min_s=o.expiry_min_s, max_s=o.expiry_max_s)

    def begin_derived_stall(self, info: ReqInfo, req_id: str) -> None:
        """The request announced its tool call and finished: the tool starts now."""
        assert info.next_stall is not None
        begin = StallBegin(
            stall_id=f"derived:{req_id}"[:200],
            session_id=info.session_id,
            run_id=info.run_id or info.session_id,
            node=info.node or info.agent_type or "agent",
            agent_type=info.agent_type,
            tool=info.next_stall.tool,
            kind=info.next_stall.kind,
            predicted_s=info.next_stall.predicted_s,
            ts=time.time(),
        )
        if self.core.sessions.apply(begin).ok:
            self.derived.put(info.session_id, True, 1)
            self.core.stats.inc("events.derived_begin")

    def end_derived_stall(self, session_id: str) -> None:
        """The session's next request arrived: its tool calls are over (every open one: two
        requests of the session in flight at once each began one)."""
        if self.derived.pop(session_id) is None:
            return
        for rec in self.core.sessions.active_stalls(session_id):
            self.end_on_the_clients_behalf(rec.begin, rec.begin_at, "events.derived_end")

    def end_on_the_clients_behalf(self, begin: StallBegin, started: float, counter: str) -> StallEnd | None:
        """Apply the ``stall_end`` the client did not send (server clock), as if it had; returns it
        (None: the tracker did not take it)."""
        end = StallEnd(
            stall_id=begin.stall_id,
            session_id=begin.session_id,
            run_id=begin.run_id,
            node=begin.node,
            tool=begin.tool,
            duration_s=max(self.core.clock() - started, 0.0),
            ts=time.time(),
        )
        if not self.core.sessions.apply(end).ok:
            return None
        self.core.stats.inc(counter)
        return end

    def end_stalls_the_request_outlived(self, session_id: str) -> None:
        """The session sent its next request while its stall is still open: the ends of its open
        tool calls were lost.

        An agent calls the model again only after its tool calls returned (the SDK sends each
        end before the next request), so the stall is over. Ended here, it is accounted against
        this request and its host pins go once the request has what it needs; left open, they
        would last until the stall expires (up to an hour). A late real end is a duplicate.
        """
        sid = self.by_session.get(session_id)
        stall = self.active.get(sid or "")
        if stall is None or stall.ended_at is not None:
            return
        for rec in self.core.sessions.active_stalls(session_id):
            self.end_on_the_clients_behalf(rec.begin, rec.begin_at, "events.inferred_end")

    def expire_ended(self, now: float) -> None:
        """Ended stalls the planner does not expire are forgotten here: never offloaded, after the
        grace period; offloaded but no longer planned (its prefetch failed or timed out: the plan
        was cancelled), as long after the end as the planner keeps a plan for a session that sends
        no request — without this its host pins would last until the session's next request."""
        waiting: set[str] | None = None  # sessions with a request queued (built when needed)
        for sid, stall in list(self.ended.items()):
            if stall.ended_at is None:
                continue
            grace = self.core.opts.end_grace_s
            if stall.offloaded:
                if self.core.planner.is_open(sid):
                    continue  # the planner expires it (``planner.expired``)
                grace = max(grace, self.core.planner.unused_after_s)
            if now - stall.ended_at < grace:
                continue
            if stall.offloaded:
                if waiting is None:
                    waiting = self.core.requests.waiting_sessions()
                if stall.session_id in waiting:
                    continue  # its request is queued: the copies stay pinned for its load
            self.release(sid)


__all__ = ["StallBook"]
