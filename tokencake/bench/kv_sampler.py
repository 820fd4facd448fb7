"""Device KV usage over a replay: vLLM's gauges (and the spatial scheduler's reserve) polled from
``/metrics`` in the background."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokencake.bench.server_metrics import metric_value
from tokencake.serving.prometheus import parse_metrics


@dataclass
class KVSampler:
    """Polls ``/metrics`` in the background and keeps ``(t, kv_usage, running, waiting)`` samples.

    ``fetch`` is an async callable returning the metrics text (or parsed
    :data:`~tokencake.serving.prometheus.Metrics`, e.g. several replicas' merged), so tests can feed
    canned text.
    """

    fetch: Callable[[], Any]
    interval_s: float = 0.5
    clock: Callable[[], float] = time.time
    samples: list[dict[str, float]] = field(default_factory=list)
    errors: int = 0

    async def sample_once(self) -> None:
        try:
            text = await self.fetch()
        except Exception:  # a slow or restarting server must not kill the benchmark
            self.errors += 1
            return
        m = text if isinstance(text, dict) else parse_metrics(text)
        self.samples.append(
            {
                "t": self.clock(),
                "kv_usage": metric_value(m, "vllm:kv_cache_usage_perc"),
                "running": metric_value(m, "vllm:num_requests_running"),
                "waiting": metric_value(m, "vllm:num_requests_waiting"),
                # The spatial scheduler's critical reserve (counters; 0 without it).
                "reserved_block_steps": metric_value(m, "vllm:tokencake_spatial_reserved_block_steps_total"),
                "spatial_steps": metric_value(m, "vllm:tokencake_spatial_steps_total"),
            }
        )

    async def run(self) -> None:
        """Sample until cancelled."""
        import anyio

        while True:
            await self.sample_once()
            await anyio.sleep(self.interval_s)

    def summary(self, t0: float) -> dict[str, Any]:
        usage = [s["kv_usage"] for s in self.samples]
        reserved = reserve_series(self.samples)
        return {
            "interval_s": self.interval_s,
            "errors": self.errors,
            "mean": sum(usage) / len(usage) if usage else None,
            "max": max(usage) if usage else None,
            "max_waiting": max((s["waiting"] for s in self.samples), default=None),
            "series": [
                {
                    "t": round(s["t"] - t0, 3),
                    "kv_usage": s["kv_usage"],
                    "running": s["running"],
                    "waiting": s["waiting"],
                    **({} if r is None else {"reserved_blocks": r}),
                }
                for s, r in zip(self.samples, reserved, strict=True)
            ],
        }


def reserve_series(samples: list[dict[str, float]]) -> list[float | None]:
    """Mean device blocks in the critical reserve between each sample and the one before it.

    From the spatial scheduler's counters (blocks held for critical-path sessions summed per engine
    step, and the steps): None where no step was counted in between (idle engine, no spatial
    scheduler, or the first sample).
    """
    out: list[float | None] = [None] * len(samples)
    for i in range(1, len(samples)):
        prev, cur = samples[i - 1], samples[i]
        steps = cur.get("spatial_steps", 0.0) - prev.get("spatial_steps", 0.0)
        if steps > 0:
            held = cur.get("reserved_block_steps", 0.0) - prev.get("reserved_block_steps", 0.0)
            out[i] = round(held / steps, 3)
    return out
