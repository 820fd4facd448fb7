"""The core's state as ``/v1/stats`` shows it (``engine`` and ``config`` sections)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

__all__ = ["config_stats", "engine_stats"]


def engine_stats(core: KVCore) -> dict[str, Any]:
    """Runs on the events listener's thread: iterate copies of the engine thread's tables
    (taken in one C call each, atomic under the GIL), never the tables themselves."""
    pool = core.pool
    jobs, kept = tuple(core.copies.jobs.values()), tuple(core.holds.kept.values())
    return {
        "device_blocks": pool.num_blocks if pool is not None else None,
        "device_free_blocks": pool.num_free() if pool is not None else None,
        "jobs_in_flight": len(core.copies.jobs),
        "abandoned_in_flight": sum(j.abandoned for j in jobs),
        "active_stalls": len(core.stalls.active),
        "demoted_stalls": len(core.eviction.demoted),
        "block_size": core.block_size,
        "block_bytes": core.block_bytes,
        "prefetch_enabled": core.prefetch_enabled,
        "demote_enabled": core.demote_enabled,
        "last_eviction_risk": None if core.steps.last_risk is None else round(core.steps.last_risk, 4),
        "alloc_blocks_per_s": round(core.steps.alloc_rate(core.clock()), 3),
        "step_wait_s": round(core.steps.step_wait_s(), 4),
        "kept_sessions": len(core.holds.kept),
        "kept_blocks": sum(len(k.blocks) for k in kept),
    }


def config_stats(core: KVCore) -> dict[str, Any]:
    """The knobs the core runs with (``/v1/stats`` ``config``)."""
    return {
        "policy": core.policy.name,
        "offload": core.opts.offload,
        "prefetch": core.opts.prefetch,
        "demand_load": core.opts.demand_load,
        "early_save": core.opts.early_save,
        "demote": core.opts.demote,
        "host_pool_blocks": core.host.num_blocks,
    }
