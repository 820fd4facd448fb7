"""The extension's key counters on vLLM's own Prometheus endpoint (``/metrics`` of the OpenAI server).

Only vLLM's public connector-stats hooks are used:

1. EngineCore, engine thread, every ``Scheduler.update_from_output``: vLLM calls the SCHEDULER
   connector's ``get_kv_connector_stats()``. The connector turns the cumulative counters of its
   ``Stats`` (the numbers behind ``/v1/stats``) into :func:`connector_totals`, keeps the change
   since the previous call (:class:`DeltaTracker`) and returns it as a
   :class:`TokenCakeKVConnectorStats`. vLLM puts ``stats.to_dict()`` into ``SchedulerStats`` and
   sends it (msgpack) to the API server process, so ``data`` is a plain ``{str: int | float}``.
2. API server process: vLLM's Prometheus logger builds the connector's
   :class:`TokenCakePromMetrics` once through the classmethod ``build_prom_metrics`` (it
   registers the counters) and calls ``observe(data, engine_idx)`` with each payload; the
   logging logger rebuilds the stats with ``build_kv_connector_stats`` and uses
   ``aggregate`` / ``reduce`` for its periodic "KV Transfer metrics" log line.

Wire keys are ``"<metric>"`` or ``"<metric>/<label value>"`` (see :data:`METRICS`); the
Prometheus names are ``vllm:tokencake_<metric>_total`` with vLLM's ``model_name`` and ``engine``
labels plus at most one metric-specific label. Every entry point is defensive: an exception is
caught, counted (``errors.get_kv_connector_stats`` in ``/v1/stats``, or
``vllm:tokencake_errors_total{hook="prom_observe"}``) and never reaches vLLM.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from tokencake.serving.prefetch import CLASSIFICATIONS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

log = logging.getLogger("vllm.tokencake")

PREFIX = "vllm:tokencake_"
#: Distinct values of one metric's label kept per engine; later values are counted as ``other``.
MAX_LABEL_VALUES = 64
OVERFLOW_LABEL = "other"
#: ``errors`` label value for a failure inside :meth:`TokenCakePromMetrics.observe`.
OBSERVE_ERROR_HOOK = "prom_observe"


@dataclass(frozen=True)
class MetricSpec:
    """One exported counter: wire key ``name`` (``name/<label value>`` when ``label`` is set)."""

    name: str
    documentation: str
    label: str | None = None
    #: Label values created up front (exported as 0 before anything happens).
    known: tuple[str, ...] = ()

    @property
    def prom_name(self) -> str:
        return PREFIX + self.name


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("offloaded_blocks", "KV blocks copied device -> host pool (confirmed offloads)."),
    MetricSpec("offloaded_bytes", "Bytes copied device -> host pool (confirmed offloads)."),
    MetricSpec(
        "uploaded_blocks",
        "KV blocks copied host pool -> device (confirmed), by path (prefetch or demand_load).",
        "path",
        ("prefetch", "demand_load"),
    ),
    MetricSpec(
        "uploaded_bytes",
        "Bytes copied host pool -> device (confirmed), by path (prefetch or demand_load).",
        "path",
        ("prefetch", "demand_load"),
    ),
    MetricSpec(
        "prefetch_outcomes",
        "Offloaded stalls classified by prefetch outcome (on_time, late, wasted, unused, expired).",
        "outcome",
        CLASSIFICATIONS,
    ),
    MetricSpec("demand_loads", "Requests whose prompt was partly loaded from the host pool (demand load)."),
    MetricSpec("prompt_tokens_from_host", "Prompt tokens planned to be served from the host pool."),
    MetricSpec(
        "stall_events",
        "Stall events received by the events listener, by type.",
        "type",
        ("stall_begin", "stall_end"),
    ),
    MetricSpec("gate_decisions", "Offload-gate decisions (first one per stall), by reason.", "reason"),
    MetricSpec(
        "spatial_reserved_block_steps",
        "Spatial scheduler: device blocks held for critical-path sessions, summed over engine steps "
        "(rate / rate(spatial_steps) / device blocks = the reserve ratio over time).",
    ),
    MetricSpec("spatial_steps", "Spatial scheduler: engine steps counted for the reserve ratio."),
    MetricSpec(
        "spatial_critical_inversions",
        "Spatial: admissions of a non-critical request that evicted a critical-path session's idle KV.",
    ),
    MetricSpec(
        "spatial_critical_inversions_unsaved",
        "Spatial: critical inversions that evicted a block with no host copy (a recompute for the "
        "critical path).",
    ),
    MetricSpec(
        "spatial_critical_inversions_late",
        "Spatial: critical inversions by an admission that could not wait without delaying its own "
        "app (plain, re-admitted, or past its slack).",
    ),
    MetricSpec(
        "spatial_critical_reserve_waits",
        "Spatial: engine steps a non-critical agent request waited (within its slack) rather than "
        "evict a critical-path session's idle KV.",
    ),
    MetricSpec(
        "preemption_steps",
        "Engine steps in which vLLM preempted running requests, by what the extension kept out of "
        "vLLM's free queue then (offload_pins: copies in flight; holds: chains held for sessions; "
        "none: a preemption stock vLLM would have had too).",
        "kept",
        ("offload_pins", "holds", "none"),
    ),
    MetricSpec("errors", "Exceptions caught (and survived) in TokenCake hooks, by hook.", "hook"),
)
SPECS: dict[str, MetricSpec] = {m.name: m for m in METRICS}

#: ``Stats`` counter -> wire key.
_DIRECT: dict[str, str] = {
    "offload.blocks": "offloaded_blocks",
    "offload.bytes": "offloaded_bytes",
    "prefetch.blocks": "uploaded_blocks/prefetch",
    "prefetch.bytes": "uploaded_bytes/prefetch",
    "load.blocks": "uploaded_blocks/demand_load",
    "load.bytes": "uploaded_bytes/demand_load",
    "demand_load.requests": "demand_loads",
    "tokens.from_host": "prompt_tokens_from_host",
    "spatial.reserved_block_steps": "spatial_reserved_block_steps",
    "spatial.steps": "spatial_steps",
    "spatial.critical_inversions": "spatial_critical_inversions",
    "spatial.critical_inversions_unsaved": "spatial_critical_inversions_unsaved",
    "spatial.critical_inversions_late": "spatial_critical_inversions_late",
    "spatial.critical_reserve_waits": "spatial_critical_reserve_waits",
}
#: ``Stats`` counter prefix -> labelled metric (the rest of the counter name is the label value).
_PREFIXED: dict[str, str] = {
    "events.": "stall_events",
    "stalls.decision.": "gate_decisions",
    "errors.": "errors",
    "preemptions.kept.": "preemption_steps",
}


def _number(value: Any) -> float | int | None:
    """``value`` if it is a finite int/float (bools excluded), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def connector_totals(counters: Mapping[str, float], prefetch_counts: Mapping[str, int]) -> dict[str, float]:
    """Cumulative values of every exported series, keyed by wire key.

    ``counters`` are the scheduler ``Stats`` counters (``Stats.counters_with_prefix("")``),
    ``prefetch_counts`` the ``PrefetchPlanner.counts()``.
    """
    out: dict[str, float] = {}
    for name, value in counters.items():
        num = _number(value)
        if num is None:
            continue
        key = _DIRECT.get(name)
        if key is None:
            for prefix, metric in _PREFIXED.items():
                if name.startswith(prefix) and len(name) > len(prefix):
                    key = f"{metric}/{name[len(prefix) :]}"
                    break
        if key is not None:
            out[key] = out.get(key, 0) + num
    for cls in CLASSIFICATIONS:
        num = _number(prefetch_counts.get(cls, 0))
        if num:
            out[f"prefetch_outcomes/{cls}"] = num
    return out


class DeltaTracker:
    """Turns cumulative totals into the change since the previous call (engine thread only).

    A total that went down (``Stats.reset()``) restarts from 0: its whole new value is the delta.
    """

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def delta(self, totals: Mapping[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in totals.items():
            prev = self._last.get(key, 0)
            change = value - prev if value >= prev else value
            if change > 0:
                out[key] = change
        self._last = dict(totals)
        return out


class TokenCakeKVConnectorStats(KVConnectorStats):
    """``data``: ``{wire key: increase}`` — plain str -> number, safe for msgpack/pickle."""

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        super().__init__(data=_clean(data))

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats | None) -> KVConnectorStats:
        """Sum ``other``'s increases into this one (in place; returns self)."""
        data = getattr(other, "data", None)
        if isinstance(data, Mapping):
            for key, value in _clean(data).items():
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The summed increases of the interval, for vLLM's "KV Transfer metrics" log line."""
        return {f"tokencake.{k}": v for k, v in sorted(self.data.items()) if v}

    def clone_and_reset(self) -> TokenCakeKVConnectorStats:
        clone = TokenCakeKVConnectorStats(self.data)
        self.reset()
        return clone


def _clean(data: Mapping[str, Any] | None) -> dict[str, int | float]:
    if not isinstance(data, Mapping):
        return {}
    out: dict[str, int | float] = {}
    for key, value in data.items():
        num = _number(value)
        if isinstance(key, str) and num is not None:
            out[key] = num
    return out


class TokenCakePromMetrics(KVConnectorPromMetrics):
    """Registers the ``vllm:tokencake_*`` counters (API server process) and feeds them deltas."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}
        #: (engine_idx, metric, label value or None) -> bound child counter
        self._children: dict[tuple[int, str, str | None], Any] = {}
        self._label_values: dict[tuple[int, str], set[str]] = {}
        for spec in METRICS:
            names = list(labelnames) + ([spec.label] if spec.label else [])
            self._counters[spec.name] = self._counter_cls(
                name=spec.prom_name, documentation=spec.documentation, labelnames=names
            )
        for engine_idx in per_engine_labelvalues:
            for spec in METRICS:
                for value in spec.known if spec.label else (None,):
                    self._child(engine_idx, spec, value)

    def _child(self, engine_idx: int, spec: MetricSpec, value: str | None) -> Any | None:
        if spec.label is None:
            value = None
        elif not value:
            return None
        key = (engine_idx, spec.name, value)
        child = self._children.get(key)
        if child is not None:
            return child
        base = self.per_engine_labelvalues.get(engine_idx)
        if base is None:
            return None
        if value is not None:
            seen = self._label_values.setdefault((engine_idx, spec.name), set())
            if value not in seen and value != OVERFLOW_LABEL and len(seen) >= MAX_LABEL_VALUES:
                return self._child(engine_idx, spec, OVERFLOW_LABEL)
            seen.add(value)
        labels = list(base) + ([value] if value is not None else [])
        child = self._children[key] = self._counters[spec.name].labels(*labels)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one payload's increases; never raises (failures count as ``errors{hook=prom_observe}``)."""
        try:
            items = list(_clean(transfer_stats_data).items())
        except Exception:
            self._count_error(engine_idx)
            return
        for key, value in items:
            try:
                if value <= 0:
                    continue
                name, _, label = key.partition("/")
                spec = SPECS.get(name)
                if spec is None:
                    continue  # a key this version does not export
                child = self._child(engine_idx, spec, label or None)
                if child is not None:
                    child.inc(value)
            except Exception:
                self._count_error(engine_idx)

    def _count_error(self, engine_idx: int) -> None:
        log.warning("TokenCake: Prometheus observe failed", exc_info=True)
        try:
            child = self._child(engine_idx, SPECS["errors"], OBSERVE_ERROR_HOOK)
            if child is not None:
                child.inc()
        except Exception:
            pass


def build_prom_metrics(
    vllm_config: VllmConfig,
    metric_types: dict[type[PromMetric], type[PromMetricT]],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> TokenCakePromMetrics | None:
    """:class:`TokenCakePromMetrics`, or None (no TokenCake metrics, server unaffected) on failure."""
    try:
        return TokenCakePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
    except Exception:
        log.exception("TokenCake: Prometheus metrics disabled (registration failed)")
        return None


def build_kv_connector_stats(data: Mapping[str, Any] | None = None) -> TokenCakeKVConnectorStats:
    try:
        return TokenCakeKVConnectorStats(data)
    except Exception:
        log.warning("TokenCake: malformed connector stats payload dropped", exc_info=True)
        return TokenCakeKVConnectorStats()


__all__ = [
    "METRICS",
    "PREFIX",
    "DeltaTracker",
    "MetricSpec",
    "TokenCakeKVConnectorStats",
    "TokenCakePromMetrics",
    "build_kv_connector_stats",
    "build_prom_metrics",
    "connector_totals",
]
