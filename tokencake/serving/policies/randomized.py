"""``random``: a seeded random choice among every action (tests: the connector must stay correct
whatever a policy decides — no leaked pins, no wrong KV, the engine keeps going)."""

from __future__ import annotations

import random

from tokencake.serving.policies._base import KVPolicy, Plan, PolicyView


class RandomPolicy(KVPolicy):
    name = "random"
    uses_events = True

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def _plan(self) -> Plan:
        r = self._rng
        action = r.choice(("offload", "keep", "discard", "none"))
        if action == "offload":
            return Plan(
                "offload",
                "random",
                prefetch=r.choice(("predictive", "at_end", "none")),
                evict_first=r.random() < 0.5,
            )
        if action == "keep":
            return Plan("keep", "random", keep_s=r.uniform(0.0, 5.0))
        return Plan(action, "random", retry=r.random() < 0.3)

    def on_finished(self, view: PolicyView) -> Plan:
        return self._plan()

    def on_stall(self, view: PolicyView) -> Plan:
        return self._plan()
