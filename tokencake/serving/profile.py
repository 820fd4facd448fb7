"""Prefill cost and copy bandwidths of one model on one machine, learned from the engine's steps.

Policies weigh a recompute against a copy or a pin: ``recompute_s(tokens)`` is the measured seconds
per prefill token × tokens (a prefix hit costs ~nothing, so only computed tokens count). Samples
come from busy steps that computed at least ``min_tokens`` tokens (decode-only steps say little
about prefill); an EWMA follows them. With a ``path`` the profile (and the transfer model's
bandwidths, D2H / H2D) is loaded at start and saved at most every ``save_every_s``, keyed by model
and hardware by the caller, so a restarted server starts from what it measured last time.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("vllm.tokencake")

__all__ = ["PrefillProfile", "profile_path"]

#: Priors before any measurement: a small model on a few CPU cores, and a GPU.
CPU_S_PER_TOKEN = 1e-3
CUDA_S_PER_TOKEN = 5e-5


def profile_path(directory: Path, model: str, device: str) -> Path:
    """``directory/<model>--<device>.json`` with both parts made file-name safe."""

    def slug(s: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("._")[-80:] or "x"

    return directory / f"{slug(model)}--{slug(device)}.json"


class PrefillProfile:
    """Seconds per computed prefill token (EWMA of step samples), optionally persisted."""

    def __init__(
        self,
        *,
        device_is_cuda: bool = False,
        path: Path | None = None,
        alpha: float = 0.2,
        min_tokens: int = 256,
        save_every_s: float = 60.0,
        clock: Any = time.monotonic,
    ) -> None:
        if not 0 < alpha <= 1 or min_tokens < 1:
            raise ValueError("alpha must be in (0, 1], min_tokens >= 1")
        self.alpha = alpha
        self.min_tokens = min_tokens
        self.path = path
        self.save_every_s = save_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._s_per_token = CUDA_S_PER_TOKEN if device_is_cuda else CPU_S_PER_TOKEN
        self._samples = 0
        self._loaded = False
        self._saved_at = clock()
        #: Bandwidths loaded from disk (the transfer model is seeded with them), or None.
        self.bandwidths: dict[str, float] | None = None
        if path is not None:
            self._load(path)

    @property
    def s_per_token(self) -> float:
        with self._lock:
            return self._s_per_token

    def recompute_s(self, tokens: int) -> float:
        return max(int(tokens), 0) * self.s_per_token

    def observe_step(self, tokens: int, seconds: float) -> None:
        """One busy step computed ``tokens`` tokens in ``seconds``."""
        if tokens < self.min_tokens or not math.isfinite(seconds) or seconds <= 0:
            return
        sample = seconds / tokens
        with self._lock:
            a = 1.0 if self._samples == 0 and not self._loaded else self.alpha
            self._s_per_token = (1 - a) * self._s_per_token + a * sample
            self._samples += 1

    def maybe_save(self, bandwidths: dict[str, float] | None = None, *, force: bool = False) -> bool:
        """Write the profile when a path is set, something was learned and enough time passed."""
        if self.path is None or self._samples == 0:
            return False
        now = self._clock()
        if not force and now - self._saved_at < self.save_every_s:
            return False
        self._saved_at = now
        data = {"s_per_token": self.s_per_token, "samples": self._samples, "bandwidths": bandwidths or {}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(self.path)
        except OSError as exc:
            log.warning("TokenCake: cannot save the prefill profile to %s (%s)", self.path, exc)
            return False
        return True

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("TokenCake: ignoring the prefill profile %s (%s)", path, exc)
            return
        value = data.get("s_per_token") if isinstance(data, dict) else None
        if isinstance(value, (int, float)) and math.isfinite(value) and 0 < value < 10:
            self._s_per_token = float(value)
            self._loaded = True
        bws = data.get("bandwidths") if isinstance(data, dict) else None
        if isinstance(bws, dict):
            good = {
                k: float(v)
                for k, v in bws.items()
                if k in ("d2h", "h2d") and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
            }
            self.bandwidths = good or None

    def stats(self) -> dict[str, Any]:
        return {
            "s_per_token": self.s_per_token,
            "samples": self._samples,
            "loaded": self._loaded,
            "path": str(self.path) if self.path is not None else None,
        }
