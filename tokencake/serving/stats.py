"""Thread-safe counters, gauges and histograms for the extension's ``/v1/stats`` endpoint.

The engine thread updates these while the events listener thread reads them, so every access
goes through one lock. Histograms keep exact totals plus a bounded window of recent values for
quantiles: enough for p50/p99 of transfer times or lateness without unbounded memory.

Memory is bounded in bytes: at most ``max_names`` counters and as many gauges, and at most
``max_histograms`` histograms of ``hist_window`` floats each (defaults: ~10 MB in all). Names are
built from reason codes, so the set is small in practice; past the cap a new name is dropped
and counted (``stats.dropped_names``) instead of growing forever.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["Histogram", "Stats", "quantile"]


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted, non-empty list (``q`` in [0, 1])."""
    if not sorted_values:
        raise ValueError("quantile of an empty list")
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = min(max(q, 0.0), 1.0) * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


class Histogram:
    """Exact count/sum/min/max plus quantiles over the last ``window`` values (not thread-safe alone)."""

    def __init__(self, window: int = 1024) -> None:
        if window < 1:
            raise ValueError("histogram window must be >= 1")
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf
        self._recent: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.count += 1
        self.total += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)
        self._recent.append(value)

    def summary(self) -> dict[str, float | int]:
        if self.count == 0:
            return {"count": 0}
        recent = sorted(self._recent)
        return {
            "count": self.count,
            "sum": self.total,
            "mean": self.total / self.count,
            "min": self.min,
            "max": self.max,
            "p50": quantile(recent, 0.50),
            "p90": quantile(recent, 0.90),
            "p99": quantile(recent, 0.99),
        }


class Stats:
    """A named registry of counters, gauges and histograms with a JSON-able :meth:`snapshot`.

    Names are free-form dotted strings (``"offload.blocks"``, ``"decisions.too_short"``).
    ``register(name, fn)`` adds a section computed at snapshot time (for example the forecaster's
    error statistics), so components keep owning their own numbers.
    """

    def __init__(self, *, hist_window: int = 1024, max_names: int = 4096, max_histograms: int = 256) -> None:
        if max_names < 1 or max_histograms < 1:
            raise ValueError("Stats bounds must be >= 1")
        self._lock = threading.Lock()
        self._hist_window = hist_window
        self.max_names = max_names
        self.max_histograms = max_histograms
        self._counters: dict[str, float] = {}
        self._gauges: dict[str, float] = {}
        self._hists: dict[str, Histogram] = {}
        self._sources: dict[str, Callable[[], Any]] = {}
        self._dropped = 0

    def inc(self, name: str, n: float = 1) -> None:
        """Add ``n`` to counter ``name`` (created at 0)."""
        with self._lock:
            if name in self._counters or len(self._counters) < self.max_names:
                self._counters[name] = self._counters.get(name, 0) + n
            else:
                self._dropped += 1

    def set(self, name: str, value: float) -> None:
        """Set gauge ``name`` to ``value`` (latest value wins)."""
        with self._lock:
            if name in self._gauges or len(self._gauges) < self.max_names:
                self._gauges[name] = value
            else:
                self._dropped += 1

    def observe(self, name: str, value: float) -> None:
        """Add one sample to histogram ``name``; non-finite values are ignored."""
        with self._lock:
            hist = self._hists.get(name)
            if hist is None:
                if len(self._hists) >= self.max_histograms:
                    self._dropped += 1
                    return
                hist = self._hists[name] = Histogram(self._hist_window)
            hist.add(float(value))

    def counter(self, name: str) -> float:
        with self._lock:
            if name == "stats.dropped_names":
                return self._dropped
            return self._counters.get(name, 0)

    def gauge(self, name: str) -> float | None:
        with self._lock:
            return self._gauges.get(name)

    def histogram(self, name: str) -> dict[str, float | int]:
        with self._lock:
            hist = self._hists.get(name)
            return hist.summary() if hist is not None else {"count": 0}

    def counters_with_prefix(self, prefix: str) -> dict[str, float]:
        """Counters whose name starts with ``prefix``, keyed by the remainder (e.g. decisions by reason)."""
        with self._lock:
            return {k[len(prefix) :]: v for k, v in self._counters.items() if k.startswith(prefix)}

    def register(self, name: str, fn: Callable[[], Any]) -> None:
        """Add a section ``name`` whose value ``fn()`` is computed at snapshot time."""
        with self._lock:
            self._sources[name] = fn

    def reset(self) -> None:
        """Clear counters, gauges and histograms (registered sources stay)."""
        with self._lock:
            self._counters.clear()
            self._gauges.clear()
            self._hists.clear()
            self._dropped = 0

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy: ``{"counters", "gauges", "histograms", <registered sections>}``.

        A failing source is reported as ``{"error": "..."}`` instead of failing the whole snapshot.
        """
        with self._lock:
            counters = dict(self._counters)
            if self._dropped:
                counters["stats.dropped_names"] = self._dropped
            out: dict[str, Any] = {
                "counters": dict(sorted(counters.items())),
                "gauges": dict(sorted(self._gauges.items())),
                "histograms": {k: h.summary() for k, h in sorted(self._hists.items())},
            }
            sources = list(self._sources.items())
        # Sources run outside the lock: they may take their own locks.
        for name, fn in sources:
            try:
                out[name] = _jsonable(fn())
            except Exception as exc:  # a broken source must not break /v1/stats
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        return out


def _jsonable(value: Any) -> Any:
    """Convert tuples/sets/non-finite floats into JSON-safe values (NaN/inf → None)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items: Iterable[Any] = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [_jsonable(v) for v in items]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
