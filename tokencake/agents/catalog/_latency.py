"""How long catalog tools take: as measured, as published, or scaled.

Catalog tools do real work (search, file writes, subprocess tests) that usually finishes in
milliseconds, while the published workloads had tools that took seconds. Benchmarks need those
stall lengths to recreate the paper's pressure, so each tool body runs inside
:meth:`LatencyModel.pace`, which sleeps out the rest of a *target* duration when the real work
was faster. The predicted time the runner reports (``predict_time``) is never changed here: the
point is to let the server's forecast meet (or miss) a realistic duration.

Modes (``LatencyModel.parse``):

- ``real``      no padding; tools take as long as their real work.
- ``paper``     pad up to the published tool time.
- ``scaled:X``  pad up to X × the published time (``scaled:0`` = as fast as possible, for tests).

Optional seeded lognormal noise (``noise`` = sigma of the log) multiplies the target, so repeated
runs with one seed see the same durations and different seeds see a spread.
"""

from __future__ import annotations

import math
import random
import threading
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

import anyio

Mode = Literal["real", "paper", "scaled"]

#: Longest padding one tool call may get, whatever the scale (guards against ``scaled:1e9``).
MAX_PAD_S = 3600.0


@dataclass
class LatencyModel:
    """Target durations for tool calls; see the module docstring for the modes."""

    mode: Mode = "real"
    scale: float = 1.0
    noise: float = 0.0
    seed: int | None = None
    _counters: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in ("real", "paper", "scaled"):
            raise ValueError(f"unknown latency mode {self.mode!r}; use real, paper or scaled:X")
        if not math.isfinite(self.scale) or self.scale < 0:
            raise ValueError(f"latency scale must be a finite number >= 0, got {self.scale!r}")
        if not math.isfinite(self.noise) or self.noise < 0:
            raise ValueError(f"latency noise must be a finite number >= 0, got {self.noise!r}")

    @classmethod
    def parse(
        cls, spec: str | LatencyModel | None, *, noise: float = 0.0, seed: int | None = None
    ) -> LatencyModel:
        """Build a model from ``real`` / ``paper`` / ``scaled:X`` (``None`` means ``real``)."""
        if isinstance(spec, LatencyModel):
            return spec
        text = (spec or "real").strip().lower()
        if text in ("real", "paper"):
            return cls(mode=text, noise=noise, seed=seed)  # type: ignore[arg-type]
        if text.startswith("scaled:"):
            raw = text.split(":", 1)[1]
            try:
                scale = float(raw)
            except ValueError:
                raise ValueError(f"bad latency {spec!r}: scaled:X needs a number, got {raw!r}") from None
            return cls(mode="scaled", scale=scale, noise=noise, seed=seed)
        raise ValueError(f"unknown latency {spec!r}; use real, paper or scaled:X (e.g. scaled:0.1)")

    @property
    def spec(self) -> str:
        """The string form accepted by :meth:`parse`."""
        return f"scaled:{self.scale:g}" if self.mode == "scaled" else self.mode

    def _noise_factor(self, tool: str) -> float:
        if self.noise <= 0:
            return 1.0
        # One reproducible stream per (seed, tool): concurrent branches calling *other* tools do
        # not shift this tool's draws.
        with self._lock:
            n = self._counters.get(tool, 0)
            self._counters[tool] = n + 1
        key = zlib.crc32(f"{self.seed}:{tool}:{n}".encode())
        return math.exp(random.Random(key).gauss(0.0, self.noise))

    def target(self, tool: str, published_s: float) -> float:
        """Seconds this call of ``tool`` should last in total (0 = no padding)."""
        if self.mode == "real" or published_s <= 0:
            return 0.0
        base = published_s * (self.scale if self.mode == "scaled" else 1.0)
        if base <= 0:
            return 0.0
        return min(MAX_PAD_S, base * self._noise_factor(tool))

    @asynccontextmanager
    async def pace(self, tool: str, published_s: float) -> AsyncIterator[None]:
        """Run the body, then sleep until the call has lasted its target duration.

        Padding happens only after a *successful* body: a tool that raised has already failed
        and should report that without delay.
        """
        started = time.monotonic()
        target = self.target(tool, published_s)
        yield
        remaining = target - (time.monotonic() - started)
        if remaining > 0:
            await anyio.sleep(remaining)


__all__ = ["MAX_PAD_S", "LatencyModel", "Mode"]
