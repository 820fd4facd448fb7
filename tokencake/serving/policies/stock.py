"""``stock``: the connector is loaded but decides nothing (vLLM's LRU, no host tier in use).

Against stock vLLM without the connector it measures what loading the extension costs by itself.
"""

from __future__ import annotations

from tokencake.serving.policies._base import KVPolicy


class StockPolicy(KVPolicy):
    name = "stock"
    uses_events = False
    demand_load = False
