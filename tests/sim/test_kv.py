"""The KV core as the simulator builds it (tokencake/sim/kv.py): as the connector builds it, and
the summary read from its counters."""

from __future__ import annotations

import pytest

from tokencake.serving.options import Options
from tokencake.sim.engine import Engine
from tokencake.sim.kv import build_core, summary
from tokencake.sim.profiles import get_profile

GPU = get_profile("h200-llama3-8b")
CPU = get_profile("cpu-measured")


def test_the_core_gets_the_connectors_arguments_from_the_profile() -> None:
    core = build_core(GPU, Options(), host_blocks=64, clock=lambda: 3.0, critical_last=True)
    assert (core.block_size, core.block_bytes, core.host.num_blocks) == (16, GPU.block_bytes, 64)
    assert core.max_step_tokens == GPU.max_batched_tokens and core.critical_last
    assert core.clock() == 3.0
    # Copies run beside the forward on a GPU: "CUDA" (return_reserve auto: on); copy rates as a
    # server that kept its profile knows them.
    assert core.reserves_returns and core.transfer.bandwidth("h2d") == GPU.h2d_bytes_per_s
    cpu = build_core(CPU, Options(), host_blocks=8, clock=lambda: 0.0, critical_last=False)
    assert not cpu.reserves_returns and cpu.transfer.bandwidth("d2h") == CPU.d2h_bytes_per_s
    forced = build_core(
        CPU, Options(return_reserve="on"), host_blocks=8, clock=lambda: 0.0, critical_last=False
    )
    assert forced.reserves_returns


def test_the_summary_reads_the_servers_counter_names() -> None:
    engine = Engine(CPU, device_blocks=8, options=Options(), host_blocks=8)
    core = engine.core
    assert core is not None
    for name, n in {
        "offload.blocks": 6,
        "prefetch.blocks": 2,
        "load.blocks": 3,
        "demand_load.requests": 1,
        "next_turn.prefix_tokens": 400,
        "next_turn.prefix_tokens_recomputed": 100,
        "readiness.eligible": 4,
        "readiness.prefetched": 1,
        "readiness.not_needed": 1,
        "readiness.loading": 1,
        "spatial.critical_inversions": 2,
    }.items():
        core.stats.inc(name, n)
    s = summary(core)
    assert (s["offloaded_blocks"], s["uploaded_blocks"], s["demand_loads"]) == (6, 5, 1)
    assert s["next_turn_recomputed_share"] == pytest.approx(0.25) and s["ready_rate"] == pytest.approx(0.75)
    assert s["critical_inversions"] == 2 and s["critical_inversions_late"] == 0
    assert s["critical_recomputed_share"] is None
    assert s["counters"]["offload.blocks"] == 6 and isinstance(s["counters"]["offload.blocks"], int)
    assert s["host_pool"] == core.host.stats() and s["prefetch_planner"] == core.planner.stats()
