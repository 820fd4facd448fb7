"""The connector's knobs (``kv_connector_extra_config``): one place for the server and the simulator.

``tokencake/serving/vllm/scheduler_side.py`` acts on them inside vLLM; ``tokencake/sim`` runs the
same mechanisms on its engine model with the same values. No vLLM import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokencake.serving.policies import DEFAULT_POLICY

__all__ = ["RESERVE_WAIT_FROM", "RETURN_RESERVE", "Options", "extra_bool"]

#: Values of ``Options.critical_reserve_wait_from``.
RESERVE_WAIT_FROM: tuple[str, ...] = ("arrival", "head")
#: Values of ``Options.return_reserve``.
RETURN_RESERVE: tuple[str, ...] = ("auto", "on", "off")


@dataclass
class Options:
    """Knobs from ``kv_connector_extra_config`` (see ``docs/architecture.md``)."""

    #: The KV policy (``tokencake.serving.policies``): tokencake, offload-all, continuum, infercept,
    #: stock, random.
    policy: str = DEFAULT_POLICY
    policy_seed: int = 0
    #: A ``keep`` (device pin) ends at most this long after the tool returned (the next request
    #: normally comes within a step or two; an agent that never sends one must not hold memory).
    keep_after_end_s: float = 5.0
    offload: bool = True
    prefetch: bool = True
    demand_load: bool = True
    #: Start saving a session's blocks when its request finishes with a tool call announced.
    early_save: bool = True
    #: Move an offloaded idle session's device blocks to the front of vLLM's eviction queue.
    demote: bool = True
    #: Hold a prefetched chain on device (one reference per block) until the session's next
    #: request is admitted. The hold yields whenever a waiting request needs the blocks to be
    #: admitted, or the free blocks fall below what the running requests may need next step.
    hold_prefetched: bool = True
    #: Prefetch starts ``lead = estimated H2D time + wait for the next step + prefetch_margin_s``
    #: before the return it aims at: the ``prefetch_quantile`` of the learned actual/predicted
    #: duration ratios × the forecast (``prefetch_prior_ratio`` × forecast before any history).
    #: None aims at the forecast itself (see tokencake.serving.prefetch).
    prefetch_margin_s: float = 0.25
    prefetch_quantile: float | None = 0.1
    prefetch_prior_ratio: float = 0.5
    #: A prefetch never takes the device below this many free blocks, nor below what the
    #: requests waiting for admission need (whichever is larger).
    prefetch_reserve_blocks: int = 0
    prefetch_reserve_frac: float = 0.05
    #: With the spatial scheduler on: critical-path sessions' idle chains are evicted last and their
    #: held chains are a reserve (below). False keeps only the spatial admission order (ablation).
    critical_last: bool = True
    #: With the spatial scheduler on (``SchedulerSide.critical_last``): device blocks held for
    #: critical-path sessions (their kept or prefetched chains, soonest return first) that a
    #: non-critical or plain admission may not take, at most this share of the device blocks...
    critical_reserve_frac: float = 0.25
    #: ...and only from a request that has waited less than this; after it, the reserve is lent.
    critical_reserve_wait_s: float = 10.0
    #: Where that wait (and the node's slack it is held against) is counted from: ``"head"`` (the
    #: scheduler's first look at the request: queueing that delays every request, critical ones
    #: too, does not spend the slack; only the wait the reserve itself adds does) or ``"arrival"``
    #: (time queued behind others uses the slack up; bench system ``reserve-arrival``).
    #: docs/policy.md §7.
    critical_reserve_wait_from: str = "head"
    #: With ``critical_last``: an admission past its slack (which may not wait for the reserve)
    #: still evicts other free blocks before a returning critical-path session's host-safe chain
    #: (it takes the chain only when nothing else is left); False: host-safe critical chains keep
    #: their place at the front (a copy brings them back) and only unsaved ones are spared.
    critical_spare_late: bool = False
    #: Room ahead of a return (docs/policy.md §4): from a stall's prefetch due time until the
    #: late end of its likely return (``PlannedStall.late_at``), the blocks its chain misses on
    #: device are kept from other agents' first admissions and its prefetch may take the room the
    #: queue would want, so the chain is back before the request. At most
    #: ``return_reserve_frac`` of the device. ``"auto"``: on where copies run beside the forward
    #: (CUDA side streams: a prefetch is free, a demand load delays the whole step), off where
    #: they share its cores (vLLM-CPU: a prefetch costs what the load would, so being ready buys
    #: nothing and the kept room only delays others); ``"on"`` / ``"off"`` force it.
    return_reserve: str = "auto"
    return_reserve_frac: float = 0.5
    #: With TokenCake's scheduler: a request held back for kept room, or because held chains just
    #: gave their blocks to a running request, waits at most this long after vLLM first looked at
    #: it; past it, it is admitted as vLLM would admit it (``tokencake.serving.admission``). The
    #: critical reserve has its own bound (``critical_reserve_wait_s``, the node's slack).
    admission_wait_s: float = 10.0
    #: With the spatial scheduler on: the admission order (``tokencake.serving.spatial.ADMISSIONS``:
    #: spatial, apps-side-by-side, static-slack, remaining-depth-first, continuum); empty: the KV
    #: policy's own (``KVPolicy.admission``).
    admission: str = ""
    #: A request waits at most this long for its session's prefetch copy before loading on demand.
    prefetch_wait_s: float = 1.0
    #: How often a retryable gate decision (no pressure yet, host full) is asked again: every
    #: ``reevaluate_s`` while requests wait for admission (pressure is building), else backing off
    #: (doubling) up to ``reevaluate_max_s`` — each ask walks the session's chain, so a thousand
    #: idle stalled sessions must not be asked 20 times a second each.
    reevaluate_s: float = 0.05
    reevaluate_max_s: float = 1.0
    #: Host copies stay pinned this long after ``stall_end`` for the session's next request.
    end_grace_s: float = 30.0
    #: Expiry of a stall without ``stall_end``: clamp(expiry_factor × predicted, min, max).
    expiry_factor: float = 4.0
    expiry_min_s: float = 60.0
    expiry_max_s: float = 3600.0
    #: A copy the workers never confirm is given up after this long (pins released).
    job_timeout_s: float = 60.0
    #: Gate thresholds (see tokencake.serving.gate). ``usage_threshold`` applies to the eviction
    #: risk of the session's blocks (see ``SchedulerSide._eviction_risk``): 0.5 = the allocations
    #: expected before the session returns would use up half the free blocks queued ahead of it.
    usage_threshold: float = 0.50
    min_waiting: int = 1
    #: Allocations expected before a stall ends are ``churn_safety ×`` the measured rate.
    churn_safety: float = 2.0
    #: Seconds of step history behind the allocation-rate estimate.
    churn_window_s: float = 10.0

    def reserves_returns(self, *, copies_beside_compute: bool) -> bool:
        """Whether room is kept ahead of returns (``return_reserve``; ``"auto"`` follows where
        the copies run)."""
        if self.return_reserve == "auto":
            return copies_beside_compute
        return self.return_reserve == "on"


def extra_bool(extra: Mapping[str, Any], name: str, default: bool) -> bool:
    """A boolean knob of ``kv_connector_extra_config``: strings such as "0", "false", "off" are False."""
    value = extra.get(name, default)
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)
