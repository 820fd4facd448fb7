"""``offload-all``: a tiered KV cache without events (what vLLM's native CPU offloading and LMCache do).

Every finished request's full blocks are stored to the host pool (only the ones not there yet);
the host pool is LRU; a later request that misses on device loads what the host holds (demand
load). No stall event is used, nothing is prefetched, vLLM's eviction order is left alone. This is
the control that says how much of TokenCake's gain needs the events at all.
"""

from __future__ import annotations

from tokencake.serving.policies._base import KVPolicy, Plan, PolicyView


class OffloadAllPolicy(KVPolicy):
    name = "offload-all"
    uses_events = False

    def on_finished(self, view: PolicyView) -> Plan:
        g = view.gate
        if view.num_blocks == 0:
            return Plan("none", "no_blocks")
        to_copy = view.num_blocks - min(max(int(g.num_on_host), 0), view.num_blocks)
        if to_copy == 0:
            return Plan("none", "already_on_host")
        if max(g.host_free_blocks, 0) + max(g.host_reclaimable_blocks, 0) < to_copy:
            return Plan("none", "host_pool_full")
        return Plan("offload", "store", prefetch="none", evict_first=False)
