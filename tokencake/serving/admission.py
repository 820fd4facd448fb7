"""Admission control: what a waiting request may take of the device, and how long it may wait.

TokenCake's scheduler (``tokencake/serving/vllm/scheduler.py``) asks the connector about every
waiting request vLLM's admission loop looks at, before vLLM's own test; the simulator
(``tokencake/sim``) asks its extension the same at the same point of its engine model. The answer
is "go on" (having released the held chains the request needs the blocks of) or "wait this pass":
vLLM then skips the request and looks at the next one. A request that does not fit whatever is
released goes on too, and vLLM's own test turns it away as stock vLLM would (it stops admitting
until running requests free blocks) — so nothing here ever stops admission for the requests
behind one that waits.

Besides the request's own ``need`` (vLLM's admission test: the blocks its prompt takes beyond its
prefix hits, the hits that sit in the free queue, the watermark), the free blocks carry three
claims:

* **kept room** (``Options.return_reserve``): blocks kept free for other sessions' due returns;
* **holds**: chains the KV policy holds on device (keeps, prefetched chains). They yield to an
  admission that needs their blocks — but for the request's own session's and the critical
  reserve's, and none while room is kept against the admission (held chains are of sessions about
  to return too: releasing them for it moved readiness from one return to another in the
  simulator), which then fits beside the kept room as the device is, or waits;
* **the critical reserve**: held chains of critical-path sessions that a non-critical admission may
  not take (``Options.critical_reserve_frac``).

Every wait is bounded: kept room and a pass whose freed blocks went to a running request hold a
request back at most ``Options.admission_wait_s`` after vLLM first looked at it
(:func:`within_wait_bound`); the critical reserve at most ``Options.critical_reserve_wait_s``
(a wait for it also ends with the node's slack, ``AdmissionControl.within_slack``); a request
for its own session's prefetch copy at most ``Options.prefetch_wait_s``. Past its bound a request
goes on as vLLM would admit it. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ADMIT", "CRITICAL_RESERVE", "KEPT_ROOM", "Room", "room_for", "within_wait_bound"]

#: Verdicts of :func:`room_for`: go on, or wait for kept room or for the critical reserve.
ADMIT = "admit"
KEPT_ROOM = "return_reserve"
CRITICAL_RESERVE = "critical_reserve"


@dataclass(frozen=True)
class Room:
    """An admission's blocks: each field counts device blocks."""

    #: Free now (idle cached blocks included: vLLM evicts them).
    free: int
    #: What vLLM's admission test wants free for the request.
    need: int
    #: Kept free for other sessions' due returns (0: none is kept against this request).
    kept: int = 0
    #: Freed by releasing every hold the request may take but those of returning sessions (the
    #: sessions whose room is kept).
    holds: int = 0
    #: Freed on top by releasing the returning sessions' holds.
    returning: int = 0
    #: Freed on top by lending the critical reserve.
    reserve: int = 0


def room_for(room: Room) -> tuple[str, int]:
    """``(verdict, target)``: :data:`ADMIT` with the free blocks to reach by releasing holds
    (``target`` 0: release none — it fits as it is, or it does not fit whatever is released);
    :data:`KEPT_ROOM`: room is kept against it and it does not fit beside it as the device is, but
    would with the kept room and the holds lent; :data:`CRITICAL_RESERVE`: it would fit only
    with the critical reserve lent. Either way it waits (``target`` 0)."""
    free, need = room.free, room.need
    if free >= need + room.kept:
        return ADMIT, 0
    if not room.kept and free + room.holds >= need:
        return ADMIT, need
    lent = free + room.holds + room.returning
    if room.kept and lent >= need:
        return KEPT_ROOM, 0
    if room.reserve and lent + room.reserve >= need:
        return CRITICAL_RESERVE, 0
    return ADMIT, 0


def within_wait_bound(since: float | None, now: float, bound_s: float) -> bool:
    """Whether a request vLLM first looked at ``since`` (None: only now) may still be held back."""
    return now - (now if since is None else since) < bound_s
