"""KV policies: who keeps, offloads or gives up an idle agent session's KV, and when it comes back.

``make_policy(name)`` builds one; ``POLICY_NAMES`` lists them (``tokencake serve --policy NAME``).
The connector calls them on vLLM's engine thread; they never import vLLM, so unit tests and the
simulator drive the very same objects. ``docs/policy.md`` compares them.

=============== ================================================================================
``tokencake``   offload when the gate says it pays, prefetch before the tool returns (default)
``offload-all`` store every finished request to an LRU host pool, load on a miss; no events
``continuum``   keep the KV on device for a TTL from the tool's duration CDF; no host tier
``infercept``   preserve / swap / discard by least memory waste; swap-in when the tool returns
``stock``       nothing (vLLM's LRU); the connector's own cost
``random``      a seeded random choice (tests)
=============== ================================================================================
"""

from __future__ import annotations

from tokencake.serving.gate import OffloadGate
from tokencake.serving.policies._base import Action, EventPolicy, KVPolicy, Plan, PolicyView, PrefetchMode
from tokencake.serving.policies.continuum import ContinuumPolicy
from tokencake.serving.policies.infercept import InferceptPolicy
from tokencake.serving.policies.offload_all import OffloadAllPolicy
from tokencake.serving.policies.randomized import RandomPolicy
from tokencake.serving.policies.stock import StockPolicy
from tokencake.serving.policies.temporal import TokenCakePolicy

POLICY_NAMES: tuple[str, ...] = ("tokencake", "offload-all", "continuum", "infercept", "stock", "random")
DEFAULT_POLICY = "tokencake"


def make_policy(name: str, *, gate: OffloadGate | None = None, seed: int = 0) -> KVPolicy:
    """The policy called ``name`` (one of :data:`POLICY_NAMES`); a clear error for anything else."""
    key = (name or DEFAULT_POLICY).strip().lower()
    if key == "tokencake":
        return TokenCakePolicy(gate if gate is not None else OffloadGate())
    if key == "offload-all":
        return OffloadAllPolicy()
    if key == "continuum":
        return ContinuumPolicy()
    if key == "infercept":
        return InferceptPolicy()
    if key == "stock":
        return StockPolicy()
    if key == "random":
        return RandomPolicy(seed)
    raise ValueError(f"unknown KV policy {name!r}; choose from {', '.join(POLICY_NAMES)}")


__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "Action",
    "ContinuumPolicy",
    "EventPolicy",
    "InferceptPolicy",
    "KVPolicy",
    "OffloadAllPolicy",
    "Plan",
    "PolicyView",
    "PrefetchMode",
    "RandomPolicy",
    "StockPolicy",
    "TokenCakePolicy",
    "make_policy",
]
