"""Export of the extension's counters through vLLM's connector-stats hooks (no server).

Covers the scheduler-side delta (``get_kv_connector_stats``), the ``KVConnectorStats`` contract
vLLM relies on (``aggregate`` / ``reduce`` / ``is_empty`` / msgpack transport) and the mapping
of payloads onto ``vllm:tokencake_*`` counters in private ``prometheus_client`` registries,
through vLLM's own ``KVConnectorProm`` / ``KVConnectorLogging`` wrappers.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from tokencake.events import StallBegin, StallEnd
from tokencake.serving.vllm import metrics as m
from tokencake.serving.vllm.connector import TokenCakeConnector
from tokencake.serving.vllm.scheduler_side import Options, SchedulerSide

LABELS = ["model_name", "engine"]
ENGINES: dict[int, list[object]] = {0: ["tiny", "0"], 1: ["tiny", "1"]}


def kv_transfer_config() -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="TokenCakeConnector",
        kv_role="kv_both",
        kv_connector_module_path="tokencake.serving.vllm.connector",
    )


def metric_types(registry: CollectorRegistry) -> dict[type, type]:
    """Counter/Gauge/Histogram classes that register in ``registry`` instead of the global one."""

    def bound(base: type) -> type:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if "_labelvalues" not in kwargs:  # parents register; labelled children never do
                kwargs.setdefault("registry", registry)
            base.__init__(self, *args, **kwargs)

        return type(f"Test{base.__name__}", (base,), {"__init__": __init__})

    return {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


def prom(registry: CollectorRegistry) -> m.TokenCakePromMetrics:
    pm = m.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), metric_types(registry), LABELS, ENGINES
    )
    assert pm is not None
    return pm


def value(registry: CollectorRegistry, name: str, engine: str = "0", **labels: str) -> float | None:
    return registry.get_sample_value(
        f"vllm:tokencake_{name}_total", {"model_name": "tiny", "engine": engine, **labels}
    )


def connector(side: SchedulerSide | None) -> TokenCakeConnector:
    """A connector with only the attributes the stats hook reads (no vLLM config needed)."""
    conn = TokenCakeConnector.__new__(TokenCakeConnector)
    conn.sched = side
    conn._prom_delta = m.DeltaTracker()
    return conn


def side() -> SchedulerSide:
    return SchedulerSide(block_size=4, block_bytes=1000, num_host_blocks=8, options=Options())


def stall_begin(stall_id: str = "s1") -> StallBegin:
    return StallBegin(
        stall_id=stall_id, session_id="run:A", run_id="run", node="A", tool="search", predicted_s=5.0, ts=0
    )


def stall_end(stall_id: str = "s1") -> StallEnd:
    return StallEnd(
        stall_id=stall_id, session_id="run:A", run_id="run", node="A", tool="search", duration_s=1.0, ts=0
    )


# ---------------------------------------------------------------- totals and deltas
def test_totals_map_stats_counters_and_prefetch_outcomes() -> None:
    counters = {
        "offload.blocks": 3,
        "offload.bytes": 3000,
        "offload.jobs": 1,  # not exported
        "prefetch.blocks": 2,
        "prefetch.bytes": 2000,
        "prefetch.on_time": 1,  # the planner's count is the source for outcomes
        "load.blocks": 1,
        "load.bytes": 1000,
        "demand_load.requests": 1,
        "demand_load.blocks": 1,  # planned, not confirmed: not exported
        "tokens.from_host": 4,
        "events.stall_begin": 2,
        "events.stall_end": 1,
        "acks.recorded": 3,
        "stalls.decision.offload": 1,
        "stalls.decision.no_pressure": 1,
        "errors.build_connector_meta": 1,
        "errors.": 5,  # no hook name: ignored
        "preemptions.kept.holds": 2,
        "preemptions.held_blocks": 9,  # not exported
    }
    planner = {"on_time": 1, "late": 0, "wasted": 2, "planned": 3}
    assert m.connector_totals(counters, planner) == {
        "offloaded_blocks": 3,
        "offloaded_bytes": 3000,
        "uploaded_blocks/prefetch": 2,
        "uploaded_bytes/prefetch": 2000,
        "uploaded_blocks/demand_load": 1,
        "uploaded_bytes/demand_load": 1000,
        "demand_loads": 1,
        "prompt_tokens_from_host": 4,
        "stall_events/stall_begin": 2,
        "stall_events/stall_end": 1,
        "gate_decisions/offload": 1,
        "gate_decisions/no_pressure": 1,
        "errors/build_connector_meta": 1,
        "preemption_steps/holds": 2,
        "prefetch_outcomes/on_time": 1,
        "prefetch_outcomes/wasted": 2,
    }


def test_delta_tracker_reports_increases_once_and_survives_a_reset() -> None:
    d = m.DeltaTracker()
    assert d.delta({"a": 2, "b": 0}) == {"a": 2}
    assert d.delta({"a": 2, "b": 0}) == {}
    assert d.delta({"a": 5, "b": 1}) == {"a": 3, "b": 1}
    assert d.delta({"a": 1, "b": 1}) == {"a": 1}  # went down (Stats.reset): restart from 0
    assert d.delta({}) == {}
    assert d.delta({"b": 2}) == {"b": 2}


def test_scheduler_hook_exports_each_increase_once() -> None:
    s = side()
    conn = connector(s)
    assert conn.get_kv_connector_stats() is None  # nothing happened yet
    s.handle_event(stall_begin())
    s.handle_event(stall_end())
    s.stats.inc("offload.blocks", 3)
    s.stats.inc("offload.bytes", 3000)
    stats = conn.get_kv_connector_stats()
    assert isinstance(stats, m.TokenCakeKVConnectorStats) and not stats.is_empty()
    assert stats.to_dict() == {
        "stall_events/stall_begin": 1,
        "stall_events/stall_end": 1,
        "offloaded_blocks": 3,
        "offloaded_bytes": 3000,
    }
    assert conn.get_kv_connector_stats() is None
    s.stats.inc("offload.blocks", 2)
    assert conn.get_kv_connector_stats().to_dict() == {"offloaded_blocks": 2}


def test_scheduler_hook_failure_is_caught_and_counted() -> None:
    s = side()
    conn = connector(s)
    planner = s.planner
    s.planner = SimpleNamespace()  # .counts() raises AttributeError
    assert conn.get_kv_connector_stats() is None
    assert s.stats.counter("errors.get_kv_connector_stats") == 1
    s.planner = planner
    assert conn.get_kv_connector_stats().to_dict() == {"errors/get_kv_connector_stats": 1}


def test_worker_side_and_disabled_connector_have_no_stats() -> None:
    assert connector(None).get_kv_connector_stats() is None


# ---------------------------------------------------------------- KVConnectorStats contract
def test_stats_aggregate_reduce_is_empty_clone() -> None:
    a = m.TokenCakeKVConnectorStats({"offloaded_blocks": 2, "gate_decisions/offload": 1})
    b = TokenCakeConnector.build_kv_connector_stats({"offloaded_blocks": 3, "demand_loads": 1})
    assert isinstance(b, m.TokenCakeKVConnectorStats)
    assert a.aggregate(b) is a
    assert a.data == {"offloaded_blocks": 5, "gate_decisions/offload": 1, "demand_loads": 1}
    assert a.reduce() == {
        "tokencake.demand_loads": 1,
        "tokencake.gate_decisions/offload": 1,
        "tokencake.offloaded_blocks": 5,
    }
    assert a.aggregate(None) is a and a.aggregate(m.TokenCakeKVConnectorStats()) is a
    clone = a.clone_and_reset()
    assert clone.data["offloaded_blocks"] == 5 and a.is_empty() and a.data == {}
    assert m.TokenCakeKVConnectorStats({"x": 0}).is_empty()
    assert TokenCakeConnector.build_kv_connector_stats(None).is_empty()


def test_stats_drop_malformed_values() -> None:
    bad: dict[Any, Any] = {"ok": 1, "s": "3", "n": None, "b": True, "nan": float("nan"), 7: 1, "f": 0.5}
    stats = m.TokenCakeKVConnectorStats(bad)
    assert stats.data == {"ok": 1, "f": 0.5}
    assert stats.aggregate(SimpleNamespace(data=["not", "a", "dict"])).data == {"ok": 1, "f": 0.5}
    assert m.build_kv_connector_stats("garbage").is_empty()  # type: ignore[arg-type]


def test_payload_survives_vllm_transport() -> None:
    """``SchedulerStats.kv_connector_stats`` crosses EngineCore -> API server as msgpack."""
    s = side()
    conn = connector(s)
    s.stats.inc("offload.bytes", 4096)
    s.stats.inc("stalls.decision.too_short")
    payload = conn.get_kv_connector_stats().to_dict()
    out = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=payload))
    got = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(out))
    assert got.scheduler_stats.kv_connector_stats == payload
    assert pickle.loads(pickle.dumps(m.TokenCakeKVConnectorStats(payload))).data == payload


def test_vllm_logging_wrapper_aggregates_and_logs() -> None:
    logging_ = KVConnectorLogging(kv_transfer_config())
    logging_.observe({"offloaded_blocks": 2})
    logging_.observe({"offloaded_blocks": 1, "demand_loads": 1})
    lines: list[str] = []
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: tokencake.demand_loads=1, tokencake.offloaded_blocks=3"]


# ---------------------------------------------------------------- Prometheus mapping
def test_counters_are_registered_with_known_labels_at_zero() -> None:
    reg = CollectorRegistry()
    prom(reg)
    for spec in m.METRICS:
        assert spec.prom_name.startswith("vllm:tokencake_")
    assert value(reg, "offloaded_blocks") == 0
    assert value(reg, "offloaded_bytes", engine="1") == 0
    assert value(reg, "uploaded_blocks", path="prefetch") == 0
    assert value(reg, "uploaded_bytes", path="demand_load") == 0
    for outcome in ("on_time", "late", "wasted", "unused", "expired"):
        assert value(reg, "prefetch_outcomes", outcome=outcome) == 0
    assert value(reg, "stall_events", type="stall_begin") == 0
    assert value(reg, "demand_loads") == 0 and value(reg, "prompt_tokens_from_host") == 0


def test_observe_maps_every_key_to_its_counter() -> None:
    reg = CollectorRegistry()
    pm = prom(reg)
    payload = {
        "offloaded_blocks": 3,
        "offloaded_bytes": 3000,
        "uploaded_blocks/prefetch": 2,
        "uploaded_bytes/prefetch": 2000,
        "uploaded_blocks/demand_load": 1,
        "uploaded_bytes/demand_load": 1000,
        "prefetch_outcomes/on_time": 1,
        "prefetch_outcomes/late": 1,
        "demand_loads": 1,
        "prompt_tokens_from_host": 128,
        "stall_events/stall_begin": 2,
        "stall_events/stall_end": 1,
        "gate_decisions/no_pressure": 1,
        "errors/build_connector_meta": 1,
    }
    pm.observe(payload, 0)
    pm.observe({"offloaded_blocks": 2, "gate_decisions/no_pressure": 1}, 0)
    pm.observe({"offloaded_blocks": 7}, 1)
    assert value(reg, "offloaded_blocks") == 5
    assert value(reg, "offloaded_blocks", engine="1") == 7
    assert value(reg, "offloaded_bytes") == 3000
    assert value(reg, "uploaded_blocks", path="prefetch") == 2
    assert value(reg, "uploaded_bytes", path="prefetch") == 2000
    assert value(reg, "uploaded_blocks", path="demand_load") == 1
    assert value(reg, "uploaded_bytes", path="demand_load") == 1000
    assert value(reg, "prefetch_outcomes", outcome="on_time") == 1
    assert value(reg, "prefetch_outcomes", outcome="late") == 1
    assert value(reg, "prefetch_outcomes", outcome="wasted") == 0
    assert value(reg, "demand_loads") == 1
    assert value(reg, "prompt_tokens_from_host") == 128
    assert value(reg, "stall_events", type="stall_begin") == 2
    assert value(reg, "stall_events", type="stall_end") == 1
    assert value(reg, "gate_decisions", reason="no_pressure") == 2
    assert value(reg, "errors", hook="build_connector_meta") == 1
    assert value(reg, "errors", hook=m.OBSERVE_ERROR_HOOK) is None  # nothing failed


def test_observe_never_raises() -> None:
    reg = CollectorRegistry()
    pm = prom(reg)
    pm.observe(None, 0)  # type: ignore[arg-type]
    pm.observe({"offloaded_blocks": -3, "demand_loads": "x", "unknown_metric": 4, "gate_decisions/": 1}, 0)
    pm.observe({"offloaded_blocks": 1}, 9)  # an engine vLLM did not announce: dropped
    assert value(reg, "offloaded_blocks") == 0
    assert value(reg, "demand_loads") == 0
    # A failing counter is counted, and the other keys of the payload still land.
    pm._children[(0, "offloaded_bytes", None)] = SimpleNamespace()  # no .inc
    pm.observe({"offloaded_bytes": 1, "demand_loads": 1}, 0)
    assert value(reg, "errors", hook=m.OBSERVE_ERROR_HOOK) == 1
    assert value(reg, "demand_loads") == 1


def test_label_values_are_bounded() -> None:
    reg = CollectorRegistry()
    pm = prom(reg)
    for i in range(m.MAX_LABEL_VALUES + 10):
        pm.observe({f"gate_decisions/r{i}": 1}, 0)
    assert value(reg, "gate_decisions", reason="other") == 10
    assert value(reg, "gate_decisions", reason=f"r{m.MAX_LABEL_VALUES - 1}") == 1


def test_failed_registration_disables_metrics_only() -> None:
    reg = CollectorRegistry()
    prom(reg)
    # Registering the same names again in the same registry raises inside prometheus_client.
    assert m.build_prom_metrics(SimpleNamespace(), metric_types(reg), LABELS, ENGINES) is None


def test_vllm_prom_wrapper_builds_and_feeds_our_counters() -> None:
    """vLLM's ``KVConnectorProm`` resolves the connector class and calls ``build_prom_metrics``."""
    reg = CollectorRegistry()
    types = metric_types(reg)

    class Prom(KVConnectorProm):
        _gauge_cls = types[Gauge]
        _counter_cls = types[Counter]
        _histogram_cls = types[Histogram]

    wrapper = Prom(SimpleNamespace(kv_transfer_config=kv_transfer_config()), LABELS, ENGINES)
    assert isinstance(wrapper.prom_metrics, m.TokenCakePromMetrics)
    wrapper.observe({"uploaded_blocks/prefetch": 4, "stall_events/stall_begin": 1}, 0)
    assert value(reg, "uploaded_blocks", path="prefetch") == 4
    assert value(reg, "stall_events", type="stall_begin") == 1


def test_end_to_end_scheduler_to_counters() -> None:
    """Totals seen by ``/v1/stats`` equal the Prometheus counters after any number of steps."""
    s = side()
    conn = connector(s)
    reg = CollectorRegistry()
    pm = prom(reg)
    for i in range(3):
        s.handle_event(stall_begin(f"s{i}"))
        s.stats.inc("load.blocks", 2)
        s.stats.inc("stalls.decision.no_blocks")
        stats = conn.get_kv_connector_stats()
        pm.observe(stats.to_dict(), 0)
        assert conn.get_kv_connector_stats() is None
    assert value(reg, "stall_events", type="stall_begin") == s.stats.counter("events.stall_begin") == 3
    assert value(reg, "uploaded_blocks", path="demand_load") == 6
    assert value(reg, "gate_decisions", reason="no_blocks") == 3
