"""The copy backend interface: lanes, handles and what a backend must guarantee.

A copy moves whole blocks between the device KV cache and the host pool on one *lane*
(:data:`LANES`): ``load`` (demand loads), ``prefetch`` and ``offload``, each with its own
ordering state and staging buffers, so a copy on one lane never waits behind another lane's.
:class:`CopyBackend` is the contract; ``_copy_cpu`` and ``_copy_cuda`` implement it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Direction = Literal["d2h", "h2d"]
#: Copy lanes, one CUDA stream (and staging buffer) each.
Lane = Literal["load", "prefetch", "offload"]
LANES: tuple[Lane, ...] = ("load", "prefetch", "offload")


class CopySubmitError(RuntimeError):
    """A copy failed after part of it was submitted; ``handle`` completes when that part has run."""

    def __init__(self, message: str, handle: CopyHandle) -> None:
        super().__init__(message)
        self.handle = handle


@dataclass
class CopyHandle:
    """One submitted copy. On CPU it is complete on return; on CUDA poll ``done()``."""

    direction: Direction
    num_blocks: int
    nbytes: int
    started: float
    lane: Lane = "offload"
    _event_start: Any = None
    _event_end: Any = None
    _seconds: float | None = None
    error: str | None = None
    _extra: dict[str, Any] = field(default_factory=dict)

    def done(self) -> bool:
        """True once the data has arrived (always true on CPU)."""
        if self._event_end is None:
            return True
        return bool(self._event_end.query())

    def wait(self) -> None:
        """Block the calling thread until the copy finished."""
        if self._event_end is not None:
            self._event_end.synchronize()

    def order_before_compute(self) -> None:
        """Make the current (compute) stream wait for this copy without blocking the host."""
        if self._event_end is not None:
            import torch

            torch.cuda.current_stream().wait_event(self._event_end)

    @property
    def seconds(self) -> float:
        """Copy duration; on CUDA measured between stream events (call after ``done()``)."""
        if self._seconds is None and self._event_end is not None and self.done():
            try:
                self._seconds = self._event_start.elapsed_time(self._event_end) / 1000.0
            except Exception:  # timing is best effort: a bad event must not fail the job
                self._seconds = time.perf_counter() - self.started
        return self._seconds if self._seconds is not None else 0.0


@dataclass
class CopyLane:
    """A copy lane: its CUDA stream (None on CPU) and its fixed staging buffers."""

    stream: Any = None
    staging: torch.Tensor | None = None
    index: torch.Tensor | None = None


def staging_buffers(
    torch: Any, device: Any, blocks: int, block_nbytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A lane's staging buffer (``blocks * block_nbytes`` bytes) and its ``blocks`` int64 ids."""
    staging = torch.empty(blocks * block_nbytes, dtype=torch.uint8, device=device)
    index = torch.empty(blocks, dtype=torch.int64, device=device)
    return staging, index


class CopyBackend(ABC):
    """Issues a copy's calls on its lane, ordered against the forward, and times it.

    A copy reads and writes device blocks only after all work the compute stream had queued
    when :meth:`run` was called. The handle :meth:`run` returns reports ``done()`` only once
    the copy can no longer touch its device blocks or host slots.
    """

    #: Whether a copy may still be running when :meth:`run` returns (poll ``done()``).
    non_blocking: bool

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch = torch
        self.device = device

    @abstractmethod
    def make_lane(self, lane: Lane, staging_blocks: int, block_nbytes: int) -> CopyLane:
        """``lane``'s ordering state and, when ``staging_blocks`` > 0, its staging buffers
        (:func:`staging_buffers`), allocated once and used by that lane's copies only."""

    @abstractmethod
    def run(self, handle: CopyHandle, lane: CopyLane, submit: Callable[[], None]) -> CopyHandle:
        """Call ``submit`` (it issues every call of one copy) on ``lane``; return ``handle``
        with its timing set. When ``submit`` raises after part of the copy may be queued,
        raise :class:`CopySubmitError` whose handle completes once that part has run; when
        nothing can be queued, the exception propagates unchanged."""


__all__ = [
    "LANES",
    "CopyBackend",
    "CopyHandle",
    "CopyLane",
    "CopySubmitError",
    "Direction",
    "Lane",
    "staging_buffers",
]
