"""TokenCake's temporal policy: offload a stalled session when the offload gate says it pays.

The gate (``tokencake/serving/gate.py``) checks time (the stall leaves room for the round trip),
need (the session's own blocks are at risk of eviction, or requests wait) and host room. Saves
start at ``request_finished`` when the request announced its tool call (so the save never races the
blocks' eviction), the upload is predictive (before the tool returns, ``PrefetchPlanner``) and
the device copies are the first to be evicted once the host copy is confirmed.
"""

from __future__ import annotations

from tokencake.serving.gate import OffloadGate
from tokencake.serving.policies._base import EventPolicy, Plan, PolicyView


class TokenCakePolicy(EventPolicy):
    name = "tokencake"

    def __init__(self, gate: OffloadGate) -> None:
        self.gate = gate

    def decide(self, view: PolicyView) -> Plan:
        decision = self.gate.decide(view.gate)
        if decision.offload:
            return Plan("offload", decision.reason, prefetch="predictive", evict_first=True)
        return Plan("none", decision.reason, retry=decision.retryable)
