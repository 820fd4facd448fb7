"""TokenCake's temporal policy: offload a stalled session when the offload gate says it pays.

The gate (``tokencake/serving/gate.py``) checks time (the stall leaves room for the round trip),
need (the session's own blocks are at risk of eviction, or requests wait) and host room. Saves
start at ``request_finished`` when the request announced its tool call (so the save never races the
blocks' eviction), the upload is predictive (before the tool returns, ``PrefetchPlanner``) and
the device copies are the first to be evicted once the host copy is confirmed.
"""

from __future__ import annotations

from typing import Any

from tokencake.serving.gate import OffloadGate
from tokencake.serving.policies._base import KVPolicy, Plan, PolicyView


class TokenCakePolicy(KVPolicy):
    name = "tokencake"
    uses_events = True

    def __init__(self, gate: OffloadGate) -> None:
        self.gate = gate

    def _plan(self, view: PolicyView) -> Plan:
        decision = self.gate.decide(view.gate)
        if decision.offload:
            return Plan("offload", decision.reason, prefetch="predictive", evict_first=True)
        return Plan("none", decision.reason, retry=decision.retryable)

    def on_finished(self, view: PolicyView) -> Plan:
        if not view.announced:
            return Plan("none", "not_announced")
        return self._plan(view)

    def on_stall(self, view: PolicyView) -> Plan:
        return self._plan(view)

    def stats(self) -> dict[str, Any]:
        return {"name": self.name}
