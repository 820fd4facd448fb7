"""The systems registry: every name, what the bench starts for it and what the simulator models.

The tables below are the registry's contract, written out by hand: a system's server flags, its
connector Options and its engine order must not change unless this file changes with them.
"""

from __future__ import annotations

from typing import Any

import pytest

from tokencake.bench.systems import SYSTEMS, ServerConfig, resolve_systems, server_kwargs
from tokencake.serving import Server
from tokencake.serving.server import SPATIAL_SCHEDULER
from tokencake.sim import SYSTEMS as SIM_SYSTEMS

SPATIAL = SPATIAL_SCHEDULER
_ON = (True, True, True)

#: name -> (stock, ideal KV, policy, --scheduler-cls, connector keys, (offload, prefetch, demand_load),
#: --scheduling-policy priority on a stock server, replicas, router policy); in `tokencake bench`'s order.
BENCH: dict[str, tuple[Any, ...]] = {
    "baseline": (True, False, None, None, {}, _ON, False, 1, None),
    "tokencake": (False, False, "tokencake", SPATIAL, {}, _ON, False, 1, None),
    "spatial-off": (False, False, "tokencake", None, {}, _ON, False, 1, None),
    "ideal": (True, True, None, None, {}, _ON, False, 1, None),
    "prefetch-off": (False, False, "tokencake", None, {}, (True, False, True), False, 1, None),
    "demand-off": (False, False, "tokencake", None, {}, (True, True, False), False, 1, None),
    "tokencake-roomy": (False, True, "tokencake", SPATIAL, {}, _ON, False, 1, None),
    "baseline-priority": (True, False, None, None, {}, _ON, True, 1, None),
    "ideal-priority": (True, True, None, None, {}, _ON, True, 1, None),
    "offload-all": (False, False, "offload-all", None, {}, _ON, False, 1, None),
    "continuum": (False, False, "continuum", None, {}, _ON, False, 1, None),
    "infercept": (False, False, "infercept", None, {}, _ON, False, 1, None),
    "stock-connector": (False, False, "stock", None, {}, _ON, False, 1, None),
    "spatial-order": (False, False, "tokencake", SPATIAL, {"critical_last": False}, _ON, False, 1, None),
    "spare-late": (False, False, "tokencake", SPATIAL, {"critical_spare_late": True}, _ON, False, 1, None),
    "reserve-arrival": (
        *(False, False, "tokencake", SPATIAL, {"critical_reserve_wait_from": "arrival"}),
        *(_ON, False, 1, None),
    ),
    "reserve-off": (False, False, "tokencake", SPATIAL, {"critical_reserve_frac": 0.0}, _ON, False, 1, None),
    "apps-side-by-side": (
        *(False, False, "tokencake", SPATIAL, {"admission": "apps-side-by-side"}),
        *(_ON, False, 1, None),
    ),
    "static-slack": (False, False, "tokencake", SPATIAL, {"admission": "static-slack"}, _ON, False, 1, None),
    "remaining-depth-first": (
        *(False, False, "tokencake", SPATIAL, {"admission": "remaining-depth-first"}),
        *(_ON, False, 1, None),
    ),
    "return-reserve": (False, False, "tokencake", SPATIAL, {"return_reserve": "on"}, _ON, False, 1, None),
    "hold-off": (False, False, "tokencake", None, {"hold_prefetched": False}, _ON, False, 1, None),
    "continuum-queue": (False, False, "continuum", SPATIAL, {}, _ON, False, 1, None),
    "replicas-affinity": (False, False, "tokencake", None, {}, _ON, False, 2, "consistent_hash"),
    "replicas-round-robin": (False, False, "tokencake", None, {}, _ON, False, 2, "round_robin"),
}

#: name -> (extension policy or None for stock vLLM, Options keys, KV size, engine admission order).
SIM: dict[str, tuple[str | None, dict[str, Any], str, str]] = {
    "baseline": (None, {}, "device", "fcfs"),
    "ideal": (None, {}, "ideal", "fcfs"),
    "tokencake": ("tokencake", {}, "device", "spatial"),
    "spatial-off": ("tokencake", {}, "device", "priority"),
    "spatial-order": ("tokencake", {"critical_last": False}, "device", "spatial"),
    "reserve-off": ("tokencake", {"critical_reserve_frac": 0.0}, "device", "spatial"),
    "spare-late": ("tokencake", {"critical_spare_late": True}, "device", "spatial"),
    "reserve-arrival": ("tokencake", {"critical_reserve_wait_from": "arrival"}, "device", "spatial"),
    "apps-side-by-side": ("tokencake", {"admission": "apps-side-by-side"}, "device", "spatial"),
    "static-slack": ("tokencake", {"admission": "static-slack"}, "device", "spatial"),
    "offload-all": ("offload-all", {}, "device", "priority"),
    "continuum": ("continuum", {}, "device", "priority"),
    "infercept": ("infercept", {}, "device", "priority"),
    "stock-connector": ("stock", {}, "device", "priority"),
    "hold-off": ("tokencake", {"hold_prefetched": False}, "device", "priority"),
    "return-reserve-off": ("tokencake", {"return_reserve": "off"}, "device", "spatial"),
    "return-reserve": ("tokencake", {"return_reserve": "on"}, "device", "spatial"),
}

CONFIG = ServerConfig(device_blocks=40, ideal_blocks=300, host_pool_blocks=64)


def test_the_bench_offers_exactly_these_systems_in_this_order() -> None:
    assert list(SYSTEMS) == list(BENCH)
    assert [s.name for s in resolve_systems(None)] == ["baseline", "tokencake", "ideal"]
    aliased = resolve_systems(["offload-only", "stock", "vllm"])
    assert aliased == [SYSTEMS["prefetch-off"], SYSTEMS["baseline"]]
    with pytest.raises(ValueError, match="unknown system 'return-reserve-off'"):
        resolve_systems(["return-reserve-off"])


@pytest.mark.parametrize("name", list(BENCH))
def test_what_the_bench_starts_for_each_system(name: str) -> None:
    stock, ideal, policy, scheduler, connector, flags, priority, replicas, router = BENCH[name]
    spec = SYSTEMS[name]
    want: dict[str, Any] = {
        "model": None,
        "baseline": stock,
        "num_gpu_blocks": 300 if ideal else 40,
        "max_model_len": 4096,
        "eager": True,
    }
    if priority:
        want["extra_args"] = ("--scheduling-policy", "priority")
    if not stock:
        want |= {"host_pool_blocks": 64, "policy": policy, "scheduler_cls": scheduler}
        if connector:
            want["connector_config"] = connector
        want |= dict(zip(("offload", "prefetch", "demand_load"), flags, strict=True))
    assert server_kwargs(spec, CONFIG, Server) == want
    recorded = spec.to_dict()
    assert recorded.pop("description")
    assert recorded == {
        "name": name,
        "stock": stock,
        "kv": "ideal" if ideal else "device",
        "flags": {} if stock else dict(zip(("offload", "prefetch", "demand_load"), flags, strict=True)),
        "priority": priority or not stock,
        "policy": policy,
        **({"connector": connector} if connector else {}),
        **({"scheduler": scheduler} if scheduler else {}),
        **({"replicas": replicas, "router_policy": router} if replicas > 1 else {}),
    }
    assert spec.replicas == replicas


def test_the_simulator_models_exactly_these_systems() -> None:
    assert set(SIM_SYSTEMS) == set(SIM)
    assert set(SIM) - set(BENCH) == {"return-reserve-off"}


@pytest.mark.parametrize("name", list(SIM))
def test_what_the_simulator_models_for_each_system(name: str) -> None:
    spec = SIM_SYSTEMS[name]
    assert (spec.policy, spec.options, spec.kv, spec.engine_scheduling()) == SIM[name]


def test_both_tools_read_the_one_registry() -> None:
    from tokencake.bench.systems import ALL_SYSTEMS

    assert set(ALL_SYSTEMS) == set(BENCH) | set(SIM)
    assert all(SYSTEMS[name] is ALL_SYSTEMS[name] for name in BENCH)
    assert all(SIM_SYSTEMS[name] is ALL_SYSTEMS[name] for name in SIM)
