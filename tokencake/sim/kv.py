"""The KV core as the simulator builds it and reads it back.

The simulated server runs the connector's own :class:`~tokencake.serving.kvcore.core.KVCore`,
built with the arguments the connector gives it (``tokencake/serving/vllm/connector.py``): the
profile's block geometry and token budget, its host pool, "CUDA" where copies run on side streams
(``copies_async``: the GPU profiles), the engine's clock. Its prefill profile starts as a server's
that kept its profile from an earlier run: the hardware profile's copy rates; the seconds per
prefill token it learns from the steps, as the server does. :func:`summary` turns the core's
``Stats`` (the counters ``/v1/stats`` shows, same names) into the result the CLI, the validation
and the benchmarks read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokencake.serving.kvcore.core import KVCore
from tokencake.serving.options import Options
from tokencake.serving.profile import PrefillProfile
from tokencake.sim.profiles import HardwareProfile

__all__ = ["CoreFactory", "build_core", "summary"]

#: Builds the core (``KVCore`` or a subclass: a benchmark's variant or probe).
CoreFactory = Callable[..., KVCore]


def build_core(
    profile: HardwareProfile,
    options: Options,
    *,
    host_blocks: int,
    clock: Callable[[], float],
    critical_last: bool,
    factory: CoreFactory = KVCore,
) -> KVCore:
    """A core for ``profile`` on the simulator's clock; ``critical_last`` as the spatial
    scheduler sets it (its eviction side)."""
    prefill = PrefillProfile(device_is_cuda=profile.copies_async, clock=clock)
    prefill.bandwidths = {"d2h": profile.d2h_bytes_per_s, "h2d": profile.h2d_bytes_per_s}
    core = factory(
        block_size=profile.block_size,
        block_bytes=profile.block_bytes,
        num_host_blocks=host_blocks,
        device_is_cuda=profile.copies_async,
        max_step_tokens=profile.max_batched_tokens,
        options=options,
        clock=clock,
        profile=prefill,
    )
    core.critical_last = critical_last
    return core


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def summary(core: KVCore) -> dict[str, Any]:
    """The run's KV figures: shares derived from the core's counters, the counters themselves
    (integral ones as ints), the host pool's and the prefetch planner's stats."""
    c = {k: int(v) if float(v).is_integer() else v for k, v in core.stats.counters_with_prefix("").items()}

    def n(name: str) -> float:
        return c.get(name, 0)

    ready = n("readiness.prefetched") + n("readiness.not_needed") + n("readiness.loading")
    return {
        "offloaded_blocks": n("offload.blocks"),
        "uploaded_blocks": n("prefetch.blocks") + n("load.blocks"),
        "demand_loads": n("demand_load.requests"),
        "next_turn_recomputed_share": _share(
            n("next_turn.prefix_tokens_recomputed"), n("next_turn.prefix_tokens")
        ),
        "ready_rate": _share(ready, n("readiness.eligible")),
        "critical_inversions": n("spatial.critical_inversions"),
        "critical_inversions_unsaved": n("spatial.critical_inversions_unsaved"),
        "critical_inversions_late": n("spatial.critical_inversions_late"),
        "critical_recomputed_share": _share(
            n("next_turn.critical.prefix_tokens_recomputed"), n("next_turn.critical.prefix_tokens")
        ),
        "counters": dict(sorted(c.items())),
        "host_pool": core.host.stats(),
        "prefetch_planner": core.planner.stats(),
    }
