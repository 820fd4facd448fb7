"""``infercept``: preserve, swap or discard each stalled session by least memory waste (InferCept).

Waste is memory × time (block-seconds), for a session with ``C`` blocks, ``M`` blocks in use by
the batch (at least ``C``), ``T`` the forecast time left in the tool call:

- preserve: ``C · T`` — the blocks sit idle on device for the whole call;
- discard: ``R · M`` — recomputing the context (``R`` s, prefill profile) on return holds up the batch;
- swap: ``(D2H + H2D) · M`` — the copies hold up the batch (our copies overlap compute, so this
  overstates the cost of a swap); impossible when the host pool has no room, and beyond the
  **swap budget**: InferCept swaps only as much as overlaps an iteration's compute. Here the swaps
  chosen so far are booked on one copy lane (each its D2H seconds, back to back); a new swap is
  possible only if it would start within ``budget_steps`` engine steps (``step_s``, measured) —
  otherwise it would queue behind the others and stall the batch, so preserve or discard wins.
  With no step time measured yet the budget does not apply.

The least wins. Swap copies the blocks to host and brings them back when the tool returns
(``at_end``); preserve holds them on device until the next request is admitted (bounded by the stall
expiry); discard puts them first in vLLM's eviction queue.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from tokencake.serving.policies._base import EventPolicy, Plan, PolicyView
from tokencake.serving.prefetch import stall_expiry_s


class InferceptPolicy(EventPolicy):
    name = "infercept"

    def __init__(self, max_sessions: int = 4096, budget_steps: float = 1.0) -> None:
        if not budget_steps > 0:
            raise ValueError(f"budget_steps must be > 0, got {budget_steps!r}")
        self.budget_steps = float(budget_steps)
        #: Engine time at which the swaps booked so far have left the device.
        self._lane_free_at = 0.0
        self._over_budget = 0
        self._last: dict[str, float] = {}
        #: Choice made at ``request_finished`` per session: the stall that follows keeps it.
        self._decided: OrderedDict[str, Plan] = OrderedDict()
        self.max_sessions = max(1, max_sessions)

    def wastes(self, view: PolicyView) -> dict[str, float]:
        """Block-seconds wasted by each choice (``inf`` where impossible)."""
        c = view.num_blocks
        m = max(view.device_used_blocks, c)
        t = view.remaining_s
        g = view.gate
        to_copy = c - min(max(int(g.num_on_host), 0), c)
        room = max(g.host_free_blocks, 0) + max(g.host_reclaimable_blocks, 0)
        copy_s = (view.d2h_s if to_copy else 0.0) + view.h2d_s
        return {
            "preserve": c * t,
            "discard": max(view.recompute_s, 0.0) * m,
            "swap": copy_s * m if room >= to_copy and self.within_budget(view) else math.inf,
        }

    def within_budget(self, view: PolicyView) -> bool:
        """Whether a swap of this session would start within the per-step swap budget."""
        if view.step_s <= 0:
            return True
        queued = max(self._lane_free_at - view.now_s, 0.0)
        return queued <= self.budget_steps * view.step_s

    def _book(self, view: PolicyView) -> None:
        start = max(self._lane_free_at, view.now_s)
        self._lane_free_at = start + max(view.d2h_s, 0.0)

    def decide(self, view: PolicyView) -> Plan:
        if view.num_blocks == 0:
            return Plan("none", "no_blocks")
        waste = self.wastes(view)
        choice = min(waste, key=lambda k: (waste[k], k))
        self._last = waste
        if not self.within_budget(view):
            self._over_budget += 1
        if choice == "preserve":
            return Plan("keep", "preserve", keep_s=stall_expiry_s(view.gate.predicted_s))
        if choice == "swap":
            self._book(view)
            return Plan("offload", "swap", prefetch="at_end", evict_first=True)
        return Plan("discard", "discard")

    def on_finished(self, view: PolicyView) -> Plan:
        plan = super().on_finished(view)
        if not view.announced:
            return plan
        self._decided[view.session_id] = plan
        self._decided.move_to_end(view.session_id)
        while len(self._decided) > self.max_sessions:
            self._decided.popitem(last=False)
        return plan

    def on_stall(self, view: PolicyView) -> Plan:
        # One choice per tool call: what was chosen when the call was announced stands.
        earlier = self._decided.pop(view.session_id, None)
        if earlier is not None and view.gate.elapsed_s <= 0:
            return earlier
        return self.decide(view)

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "last_waste": {k: round(v, 4) for k, v in self._last.items()},
            "over_swap_budget": self._over_budget,
        }
