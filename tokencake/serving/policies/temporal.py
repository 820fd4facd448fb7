"""TokenCake's temporal policy: offload a stalled session when the offload gate says it pays.

The gate (``tokencake/serving/gate.py``) checks time (the stall leaves room for the round trip),
need (the session's own blocks are at risk of eviction, or requests wait) and host room. Saves
start at ``request_finished`` when the request announced its tool call (so the save never races the
blocks' eviction) — there also when the only objection is "no pressure yet" and the host pool has
room for the chain (``spare_room``: free slots, unheld copies, or those of later returns) — the upload is
predictive (before the tool returns, ``PrefetchPlanner``) and the device copies are the first to be
evicted once the host copy is confirmed. When the host pool is full, a save may take the host
copies of stalled sessions predicted to return later than its own (``preempts_host``, the tail of
the latest returner first): what the pool keeps is what comes back soonest.
"""

from __future__ import annotations

from tokencake.serving.gate import OffloadGate
from tokencake.serving.policies._base import EventPolicy, Plan, PolicyView


class TokenCakePolicy(EventPolicy):
    name = "tokencake"
    #: A full host pool keeps the sessions that return soonest (their predicted returns are known).
    preempts_host = True

    def __init__(self, gate: OffloadGate) -> None:
        self.gate = gate

    def decide(self, view: PolicyView) -> Plan:
        decision = self.gate.decide(view.gate)
        if decision.offload:
            return Plan("offload", decision.reason, prefetch="predictive", evict_first=True)
        if (
            view.at_finish
            and decision.reason == "no_pressure"
            and self._spare_room(view, decision.blocks_to_copy)
        ):
            # No pressure *yet*: pressure that builds while the tool runs may evict the blocks
            # before the stall is asked again, and the tail is then recomputed. An announced
            # stall's chain is about to be needed again, so it may take what a save under pressure
            # could take: free slots, copies nobody holds (LRU), and the copies of stalls predicted
            # to return later — never a copy that another session needs sooner.
            return Plan("offload", "spare_room", prefetch="predictive", evict_first=True)
        return Plan("none", decision.reason, retry=decision.retryable)

    @staticmethod
    def _spare_room(view: PolicyView, to_copy: int) -> bool:
        """Host room for every block not on host yet (the gate's room rule)."""
        return 0 < to_copy <= view.gate.host_room
