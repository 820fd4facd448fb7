"""Should a stalled session's KV blocks be copied to the host pool? The offload gate.

Offloading pays only when three things hold (``docs/policy.md`` has the full rule):

1. **time**: the stall leaves room for the round trip,
   ``remaining − (D2H_new + H2D_all) ≥ margin`` with ``margin = max(min_margin_s, margin_factor × transfer)``;
2. **need**: freeing the blocks helps someone — device KV usage ≥ ``usage_threshold``, or requests
   are waiting, or the device is in an emergency (usage ≥ ``emergency_usage``; the margin then drops
   to zero);
3. **room**: the host pool has free or reclaimable slots for the blocks not already there.

Transfer times come from :class:`TransferModel`, which starts from conservative bandwidths and
follows measured copies with an EWMA. The gate is deterministic: same input, same decision.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = [
    "REASONS",
    "RETRYABLE",
    "Decision",
    "Direction",
    "GateInput",
    "OffloadGate",
    "TransferModel",
]

Direction = Literal["d2h", "h2d"]

#: Every reason code the gate can return, in the order the checks run.
REASONS: tuple[str, ...] = (
    "disabled",
    "unknown_session",
    "no_blocks",
    "already_on_host",
    "too_short",
    "no_pressure",
    "host_pool_full",
    "offload",
)
#: Reasons whose decision may change if asked again later in the same stall (pressure or room can appear).
RETRYABLE: frozenset[str] = frozenset({"too_short", "no_pressure", "host_pool_full"})


class TransferModel:
    """Estimated copy time ``base_s + bytes / bandwidth`` per direction, refined by observed copies.

    Defaults: 12 GB/s each way for CUDA (pinned PCIe, TokenCake's default); 5 GB/s for the CPU
    backend (host↔host ``index_copy_`` of bf16 blocks measured ~10 GB/s on a 2-core machine, halved
    to stay conservative). Observed copies update the bandwidth with an EWMA (``alpha``); copies
    smaller than ``min_observe_bytes`` are ignored because fixed overhead dominates them.
    """

    CUDA_BYTES_PER_S = 12e9
    CPU_BYTES_PER_S = 5e9

    def __init__(
        self,
        *,
        d2h_bytes_per_s: float = CUDA_BYTES_PER_S,
        h2d_bytes_per_s: float = CUDA_BYTES_PER_S,
        base_s: float = 0.0005,
        alpha: float = 0.3,
        min_observe_bytes: int = 1 << 20,
        min_bytes_per_s: float = 1e7,
        max_bytes_per_s: float = 1e12,
    ) -> None:
        if d2h_bytes_per_s <= 0 or h2d_bytes_per_s <= 0:
            raise ValueError("bandwidths must be > 0")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.base_s = base_s
        self.alpha = alpha
        self.min_observe_bytes = min_observe_bytes
        self._bounds = (min_bytes_per_s, max_bytes_per_s)
        self._bw: dict[str, float] = {"d2h": float(d2h_bytes_per_s), "h2d": float(h2d_bytes_per_s)}
        self._observed: dict[str, int] = {"d2h": 0, "h2d": 0}
        self._lock = threading.Lock()

    @classmethod
    def for_device(cls, device_is_cuda: bool, **kwargs: Any) -> TransferModel:
        """Defaults for a CUDA device (12 GB/s) or the CPU backend (5 GB/s); kwargs override."""
        bw = cls.CUDA_BYTES_PER_S if device_is_cuda else cls.CPU_BYTES_PER_S
        kwargs.setdefault("d2h_bytes_per_s", bw)
        kwargs.setdefault("h2d_bytes_per_s", bw)
        return cls(**kwargs)

    def bandwidth(self, direction: Direction) -> float:
        """Current bytes/s estimate for ``direction`` (``"d2h"`` or ``"h2d"``)."""
        with self._lock:
            return self._bw[_check_direction(direction)]

    def estimate(self, direction: Direction, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` in ``direction``; 0 for nothing to copy."""
        if nbytes <= 0:
            return 0.0
        return self.base_s + nbytes / self.bandwidth(direction)

    def observe(self, direction: Direction, nbytes: int, seconds: float) -> None:
        """Feed one measured copy; implausible samples (tiny, zero or non-finite time) are ignored."""
        direction = _check_direction(direction)
        if nbytes < self.min_observe_bytes or not math.isfinite(seconds) or seconds <= 0:
            return
        effective = max(seconds - self.base_s, seconds * 0.1)
        sample = min(max(nbytes / effective, self._bounds[0]), self._bounds[1])
        with self._lock:
            self._bw[direction] = (1 - self.alpha) * self._bw[direction] + self.alpha * sample
            self._observed[direction] += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "d2h_bytes_per_s": self._bw["d2h"],
                "h2d_bytes_per_s": self._bw["h2d"],
                "base_s": self.base_s,
                "observed_d2h": self._observed["d2h"],
                "observed_h2d": self._observed["h2d"],
            }


def _check_direction(direction: str) -> str:
    if direction not in ("d2h", "h2d"):
        raise ValueError(f"direction must be 'd2h' or 'h2d', got {direction!r}")
    return direction


@dataclass(frozen=True)
class GateInput:
    """What the gate needs to know about one stall and the engine's state right now."""

    #: Forecast stall duration (seconds from stall begin).
    predicted_s: float
    #: The session's cached full blocks on device (the prefix to protect).
    num_blocks: int
    #: Bytes of one block across all layers (``tokencake.serving.vllm._copy.BlockCopier.block_bytes``).
    block_bytes: int
    #: Device KV usage in [0, 1] (used blocks / total).
    device_usage: float
    #: Requests waiting for admission (queued demand).
    num_waiting: int
    #: Free host-pool slots.
    host_free_blocks: int
    #: Of ``num_blocks``, how many are already READY in the host pool (need no copy).
    num_on_host: int = 0
    #: Ready host slots nobody owns (LRU-reclaimable).
    host_reclaimable_blocks: int = 0
    #: Host slots of stalled sessions predicted to return later than this one, which a save of
    #: this one may take (Belady's rule on predicted returns; 0 for policies that never preempt).
    host_preemptible_blocks: int = 0
    #: Seconds already elapsed since stall begin (re-evaluation shrinks the remaining window).
    elapsed_s: float = 0.0

    @property
    def host_room(self) -> int:
        """Host slots a save may use: free, unheld (LRU) and those of later returns."""
        return (
            max(self.host_free_blocks, 0)
            + max(self.host_reclaimable_blocks, 0)
            + max(self.host_preemptible_blocks, 0)
        )

    #: False when the session has never finished a request here (nothing known to offload).
    session_known: bool = True
    #: Caller-declared emergency (e.g. preemptions this step); same effect as high usage.
    emergency: bool = False


@dataclass(frozen=True)
class Decision:
    """The gate's verdict; ``reason`` is one of :data:`REASONS`."""

    offload: bool
    reason: str
    #: Blocks that must be copied device → host (not already on host).
    blocks_to_copy: int = 0
    est_d2h_s: float = 0.0
    est_h2d_s: float = 0.0
    margin_s: float = 0.0
    #: remaining − transfer − margin (≥ 0 means the time check passed).
    slack_s: float = 0.0
    remaining_s: float = 0.0
    emergency: bool = False
    #: True when asking again later in the same stall could give another answer.
    retryable: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def remaining_s(predicted_s: float, elapsed_s: float, overdue_factor: float) -> float:
    """Expected seconds left in a stall: the forecast's rest, or ``overdue_factor × elapsed`` once the
    stall has outlived its forecast (E[T − t | T > t] = t / (α − 1) for a Pareto tail; α = 3 → 0.5)."""
    elapsed = max(elapsed_s, 0.0)
    left = predicted_s - elapsed
    return left if left > 0 else overdue_factor * elapsed


class OffloadGate:
    """Deterministic offload decision for one stall; counts decisions by reason (thread-safe)."""

    def __init__(
        self,
        transfer: TransferModel | None = None,
        *,
        enabled: bool = True,
        min_margin_s: float = 0.05,
        margin_factor: float = 2.0,
        usage_threshold: float = 0.60,
        emergency_usage: float = 0.85,
        min_waiting: int = 1,
        overdue_factor: float = 0.5,
    ) -> None:
        """``usage_threshold=0`` offloads regardless of pressure; ``min_waiting=0`` ignores the queue.

        ``overdue_factor``: once a stall outlives its forecast, its remaining time is estimated as
        ``overdue_factor × elapsed`` (heavy-tailed tool times: the longer a call has run, the longer
        it is likely to run on), so an overdue stall is not written off as "too short" forever.
        """
        if overdue_factor < 0:
            raise ValueError("overdue_factor must be >= 0")
        self.overdue_factor = overdue_factor
        if min_margin_s < 0 or margin_factor < 0:
            raise ValueError("min_margin_s and margin_factor must be >= 0")
        if not 0 <= usage_threshold <= 1 or not 0 <= emergency_usage <= 1:
            raise ValueError("usage thresholds must be in [0, 1]")
        self.transfer = transfer if transfer is not None else TransferModel()
        self.enabled = enabled
        self.min_margin_s = min_margin_s
        self.margin_factor = margin_factor
        self.usage_threshold = usage_threshold
        self.emergency_usage = emergency_usage
        self.min_waiting = min_waiting
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(REASONS, 0)

    def decide(self, inp: GateInput) -> Decision:
        """Apply the rule (checks in :data:`REASONS` order; the first failing check names the reason)."""
        decision = self._decide(inp)
        with self._lock:
            self._counts[decision.reason] += 1
        return decision

    def _decide(self, inp: GateInput) -> Decision:
        if not self.enabled:
            return Decision(False, "disabled")
        if not inp.session_known:
            return Decision(False, "unknown_session")
        num_blocks = max(int(inp.num_blocks), 0)
        if num_blocks == 0:
            return Decision(False, "no_blocks")
        to_copy = num_blocks - min(max(int(inp.num_on_host), 0), num_blocks)
        if to_copy == 0:
            # Every block already has a host copy: the device copies may go at no transfer cost.
            return Decision(True, "already_on_host")

        block_bytes = max(int(inp.block_bytes), 0)
        d2h = self.transfer.estimate("d2h", to_copy * block_bytes)
        h2d = self.transfer.estimate("h2d", num_blocks * block_bytes)
        transfer = d2h + h2d
        predicted = inp.predicted_s if math.isfinite(inp.predicted_s) else 0.0
        remaining = remaining_s(predicted, inp.elapsed_s, self.overdue_factor)
        usage = inp.device_usage if math.isfinite(inp.device_usage) else 0.0
        emergency = inp.emergency or usage >= self.emergency_usage
        margin = 0.0 if emergency else max(self.min_margin_s, self.margin_factor * transfer)
        slack = remaining - transfer - margin
        common = {
            "blocks_to_copy": to_copy,
            "est_d2h_s": d2h,
            "est_h2d_s": h2d,
            "margin_s": margin,
            "slack_s": slack,
            "remaining_s": remaining,
            "emergency": emergency,
        }
        if slack < 0:
            return Decision(False, "too_short", retryable="too_short" in RETRYABLE, **common)
        waiting = self.min_waiting > 0 and inp.num_waiting >= self.min_waiting
        pressure = emergency or usage >= self.usage_threshold or waiting
        if not pressure:
            return Decision(False, "no_pressure", retryable="no_pressure" in RETRYABLE, **common)
        if inp.host_room < to_copy:
            return Decision(False, "host_pool_full", retryable="host_pool_full" in RETRYABLE, **common)
        return Decision(True, "offload", **common)

    def counts(self) -> dict[str, int]:
        """Decisions made so far, by reason."""
        with self._lock:
            return dict(self._counts)

    def stats(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "decisions": self.counts(),
            "config": {
                "min_margin_s": self.min_margin_s,
                "margin_factor": self.margin_factor,
                "usage_threshold": self.usage_threshold,
                "emergency_usage": self.emergency_usage,
                "min_waiting": self.min_waiting,
            },
            "transfer": self.transfer.stats(),
        }
