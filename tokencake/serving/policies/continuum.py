"""``continuum``: keep a session's KV on device through a tool call for a time-to-live (Continuum).

The TTL for a tool call of key ``k`` (agent type / tool) is

    τ* = argmax over τ ∈ {0} ∪ {observed durations of k} of  F_k(τ) · (η · T + R) − τ

with ``F_k`` the empirical CDF of the key's last ``window`` durations, ``T`` the recent mean
queueing delay of requests (what a returning request waits if it must queue for memory again),
``R`` the cost of getting the KV back without the pin (recompute from the prefill profile, or the
host → device copy when a host copy exists) and ``η`` a weight (1). Before any history:
``τ = max(0, ln(η · T + R))``. The pin is soft: the connector drops it when the session's next
request is admitted, when the TTL runs out, or — latest return first — when the engine cannot
make progress without the blocks. Nothing is offloaded. (Continuum also prefers waiting requests
whose program has retained KV; that needs a scheduler, not a connector: see issue 12.)
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any

from tokencake.serving.policies._base import EventPolicy, Plan, PolicyView


class ContinuumPolicy(EventPolicy):
    name = "continuum"
    #: Continuum schedules a program whose KV it retains first (spatial scheduler on).
    admission = "continuum"

    def __init__(
        self,
        *,
        eta: float = 1.0,
        window: int = 64,
        max_keys: int = 1024,
        max_ttl_s: float = 300.0,
        delay_alpha: float = 0.2,
    ) -> None:
        if eta < 0 or window < 1 or max_keys < 1 or max_ttl_s < 0 or not 0 < delay_alpha <= 1:
            raise ValueError("eta >= 0, window >= 1, max_keys >= 1, max_ttl_s >= 0, 0 < delay_alpha <= 1")
        self.eta = eta
        self.window = window
        self.max_keys = max_keys
        self.max_ttl_s = max_ttl_s
        self.delay_alpha = delay_alpha
        self._durations: OrderedDict[str, deque[float]] = OrderedDict()
        self._delay_s = 0.0
        self._delay_n = 0

    # ---- learning
    def observe_stall_end(self, key: str, duration_s: float) -> None:
        if not math.isfinite(duration_s) or duration_s < 0:
            return
        hist = self._durations.get(key)
        if hist is None:
            hist = self._durations[key] = deque(maxlen=self.window)
            while len(self._durations) > self.max_keys:
                self._durations.popitem(last=False)
        self._durations.move_to_end(key)
        hist.append(float(duration_s))

    def observe_queue_delay(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        self._delay_n += 1
        a = 1.0 if self._delay_n == 1 else self.delay_alpha
        self._delay_s = (1 - a) * self._delay_s + a * seconds

    # ---- the rule
    def ttl(self, key: str, reload_s: float) -> float:
        """τ* for a tool call of ``key`` whose KV costs ``reload_s`` to get back without the pin."""
        benefit = self.eta * self._delay_s + max(reload_s, 0.0)
        hist = self._durations.get(key)
        if not hist:
            return min(max(0.0, math.log(benefit)) if benefit > 0 else 0.0, self.max_ttl_s)
        xs = sorted(hist)
        best_tau, best = 0.0, 0.0
        for i, tau in enumerate(xs):
            if tau > self.max_ttl_s:
                break
            # F(τ): share of observed calls that returned within τ (ties: the last equal index).
            value = (i + 1) / len(xs) * benefit - tau
            if value > best:
                best_tau, best = tau, value
        return best_tau

    def decide(self, view: PolicyView) -> Plan:
        if view.num_blocks == 0:
            return Plan("none", "no_blocks")
        on_host = min(max(int(view.gate.num_on_host), 0), view.num_blocks)
        reload_s = view.recompute_s if on_host < view.num_blocks else min(view.recompute_s, view.h2d_s)
        tau = self.ttl(view.key, reload_s) - max(view.gate.elapsed_s, 0.0)
        if tau <= 0:
            return Plan("none", "ttl_zero")
        return Plan("keep", "ttl", keep_s=tau)

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "eta": self.eta,
            "queue_delay_s": round(self._delay_s, 4),
            "keys": len(self._durations),
        }
