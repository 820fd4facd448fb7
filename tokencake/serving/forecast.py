"""How long will this tool call stall the agent? Client hint + learned history per (agent type, tool).

The offload gate and the prefetch planner both start from this number, so the rule is simple
and documented (see ``docs/policy.md``):

* no hint, no history → ``default_s`` (1 s), source ``"default"``;
* hint only → the hint, source ``"hint"`` (or ``"stages"`` when the hint is the sum of the stages);
* history only → the EWMA of observed durations (α = 0.5), source ``"history"``;
* both → ``hint_weight · hint + (1 − hint_weight) · EWMA`` (0.5 = the mean, as in TokenCake),
  source ``"blend"``.

The client's ``predicted_s`` wins over the sum of its ``stages``; the stages are used only when the
hint is missing. Keys live in a bounded LRU so an adversarial client cannot grow memory.

Two clamps keep one event from steering the server (both counted in ``stats()``):

* every forecast, hint and stage sum is capped at ``max_s`` (:data:`MAX_FORECAST_S`, 300 s). A
  stall's expiry is ``clamp(4 × forecast, 60 s, 3600 s)``, so no single ``stall_begin`` pins host
  slots for more than 20 minutes, whatever its ``predicted_s``;
* a measured duration is capped at ``max(outlier_factor × reference, outlier_floor_s)`` before it
  enters the history, where the reference is the largest of the prediction used at begin, the
  EWMA and the recent p90 (:data:`OUTLIER_FACTOR` 4, :data:`OUTLIER_FLOOR_S` 30 s). One bogus
  ``duration_s`` then moves a key's EWMA by at most half of that bound; a tool that really became
  slower is still learned, the bound growing ×4 with each report.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tokencake.serving.stats import quantile

__all__ = [
    "MAX_FORECAST_S",
    "OUTLIER_FACTOR",
    "OUTLIER_FLOOR_S",
    "DurationForecaster",
    "ErrorStats",
    "Forecast",
    "ForecastSource",
]

#: Upper bound of any forecast, hint or learned duration (seconds).
MAX_FORECAST_S = 300.0
#: A measured duration counts at most this many times the reference (see the module doc)…
OUTLIER_FACTOR = 4.0
#: …but durations up to this many seconds always count in full.
OUTLIER_FLOOR_S = 30.0

ForecastSource = Literal["default", "hint", "stages", "history", "blend"]


@dataclass(frozen=True)
class Forecast:
    """A predicted stall duration in seconds with a plausible range and where it came from."""

    seconds: float
    source: ForecastSource
    #: Lower / upper plausible bounds (p10 / p90 of the recent history, widened to include ``seconds``).
    low: float
    high: float
    hint_s: float | None = None
    history_s: float | None = None
    samples: int = 0


@dataclass
class ErrorStats:
    """Prediction error accumulators; error = predicted − actual (positive = overestimate)."""

    count: int = 0
    abs_sum: float = 0.0
    signed_sum: float = 0.0

    def add(self, predicted: float, actual: float) -> None:
        err = predicted - actual
        self.count += 1
        self.abs_sum += abs(err)
        self.signed_sum += err

    def as_dict(self) -> dict[str, float | int | None]:
        if self.count == 0:
            return {"count": 0, "mae_s": None, "mean_signed_error_s": None}
        return {
            "count": self.count,
            "mae_s": self.abs_sum / self.count,
            "mean_signed_error_s": self.signed_sum / self.count,
        }


class _KeyHistory:
    def __init__(self, window: int) -> None:
        self.ewma: float | None = None
        self.samples = 0
        self.recent: deque[float] = deque(maxlen=window)
        self.errors = ErrorStats()


def _clean(value: float | None) -> float | None:
    """A usable non-negative finite number, or None (bad input is ignored, never raised)."""
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(v) or v < 0:
        return None
    return v


def _stages_sum(stages: Mapping[str, float] | None) -> float | None:
    if not stages:
        return None
    total = 0.0
    for v in stages.values():
        c = _clean(v)
        if c is None:
            return None
        total += c
    return total if total > 0 else None


class DurationForecaster:
    """Predicts stall durations and learns from observed ones; thread-safe.

    ``predict`` is called at ``stall_begin`` (listener or engine thread) and ``observe`` at
    ``stall_end`` with the client-measured duration and what was predicted at begin.
    """

    def __init__(
        self,
        alpha: float = 0.5,
        *,
        default_s: float = 1.0,
        hint_weight: float = 0.5,
        window: int = 32,
        max_keys: int = 1024,
        max_s: float = MAX_FORECAST_S,
        outlier_factor: float = OUTLIER_FACTOR,
        outlier_floor_s: float = OUTLIER_FLOOR_S,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not 0 <= hint_weight <= 1:
            raise ValueError(f"hint_weight must be in [0, 1], got {hint_weight}")
        if default_s < 0 or window < 1 or max_keys < 1:
            raise ValueError("default_s must be >= 0, window and max_keys >= 1")
        if not max_s > 0 or outlier_factor < 1 or outlier_floor_s < 0:
            raise ValueError("max_s must be > 0, outlier_factor >= 1, outlier_floor_s >= 0")
        self.alpha = alpha
        self.default_s = default_s
        self.hint_weight = hint_weight
        self.window = window
        self.max_keys = max_keys
        self.max_s = max_s
        self.outlier_factor = outlier_factor
        self.outlier_floor_s = outlier_floor_s
        self._lock = threading.Lock()
        self._keys: OrderedDict[tuple[str, str], _KeyHistory] = OrderedDict()
        self._errors = ErrorStats()
        self._by_source: dict[str, int] = {}
        self._evicted_keys = 0
        self._clamped_hints = 0
        self._clamped_observations = 0

    def predict(
        self,
        agent_type: str,
        tool: str,
        hint_s: float | None = None,
        stages: Mapping[str, float] | None = None,
    ) -> Forecast:
        """Forecast one stall of ``tool`` called by an agent of ``agent_type`` (rule in the module doc)."""
        hint = _clean(hint_s)
        hint_source: ForecastSource = "hint"
        if hint is None:
            hint = _stages_sum(stages)
            hint_source = "stages"
        with self._lock:
            if hint is not None and hint > self.max_s:
                hint = self.max_s
                self._clamped_hints += 1
            hist = self._keys.get((agent_type, tool))
            if hist is not None:
                self._keys.move_to_end((agent_type, tool))
            ewma = hist.ewma if hist is not None else None
            samples = hist.samples if hist is not None else 0
            recent = sorted(hist.recent) if hist is not None else []
            if hint is None and ewma is None:
                seconds, source = self.default_s, "default"
            elif ewma is None:
                assert hint is not None
                seconds, source = hint, hint_source
            elif hint is None:
                seconds, source = ewma, "history"
            else:
                seconds = self.hint_weight * hint + (1 - self.hint_weight) * ewma
                source = "blend"
            seconds = min(seconds, self.max_s)
            self._by_source[source] = self._by_source.get(source, 0) + 1
        if recent:
            low = min(seconds, quantile(recent, 0.10))
            high = max(seconds, quantile(recent, 0.90))
        else:
            low = high = seconds
        return Forecast(
            seconds=seconds,
            source=source,  # type: ignore[arg-type]
            low=low,
            high=high,
            hint_s=hint,
            history_s=ewma,
            samples=samples,
        )

    def observe(self, agent_type: str, tool: str, actual_s: float, predicted_s: float | None = None) -> None:
        """Learn one measured duration; ``predicted_s`` (what was used at begin) feeds the error stats.

        Negative, NaN or infinite durations are ignored; outliers are capped (module doc), so a
        single report cannot poison the forecast that every session of the key shares.
        """
        actual = _clean(actual_s)
        if actual is None:
            return
        predicted = _clean(predicted_s)
        key = (agent_type, tool)
        with self._lock:
            hist = self._keys.get(key)
            if hist is None:
                hist = self._keys[key] = _KeyHistory(self.window)
                while len(self._keys) > self.max_keys:
                    self._keys.popitem(last=False)
                    self._evicted_keys += 1
            else:
                self._keys.move_to_end(key)
            bound = min(self.max_s, self._outlier_bound(hist, predicted))
            if actual > bound:
                actual = bound
                self._clamped_observations += 1
            hist.ewma = actual if hist.ewma is None else self.alpha * actual + (1 - self.alpha) * hist.ewma
            hist.samples += 1
            hist.recent.append(actual)
            if predicted is not None:
                hist.errors.add(predicted, actual)
                self._errors.add(predicted, actual)

    def _outlier_bound(self, hist: _KeyHistory, predicted: float | None) -> float:
        """The largest duration one report may contribute (``inf`` with nothing to compare to)."""
        refs = [r for r in (predicted, hist.ewma) if r is not None]
        if hist.recent:
            refs.append(quantile(sorted(hist.recent), 0.9))
        if not refs:
            return math.inf
        return max(self.outlier_factor * max(refs), self.outlier_floor_s)

    def key_stats(self, agent_type: str, tool: str) -> dict[str, Any] | None:
        """History and error statistics of one key, or None if never observed (or evicted)."""
        with self._lock:
            hist = self._keys.get((agent_type, tool))
            if hist is None:
                return None
            return self._key_dict(hist)

    def _key_dict(self, hist: _KeyHistory) -> dict[str, Any]:
        recent = sorted(hist.recent)
        return {
            "samples": hist.samples,
            "ewma_s": hist.ewma,
            "p50_s": quantile(recent, 0.5) if recent else None,
            "p90_s": quantile(recent, 0.9) if recent else None,
            "error": hist.errors.as_dict(),
        }

    def stats(self, *, max_keys_listed: int = 50) -> dict[str, Any]:
        """Global error stats, predictions by source and the most recently used keys (JSON-able)."""
        with self._lock:
            keys = list(self._keys.items())[-max_keys_listed:]
            return {
                "keys": len(self._keys),
                "evicted_keys": self._evicted_keys,
                "clamped_hints": self._clamped_hints,
                "clamped_observations": self._clamped_observations,
                "predictions_by_source": dict(self._by_source),
                "error": self._errors.as_dict(),
                "by_key": {f"{a}/{t}": self._key_dict(h) for (a, t), h in reversed(keys)},
            }
