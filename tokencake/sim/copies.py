"""The simulator's timed copy engine: it stands where vLLM's workers stand for the KV core.

The core plans copies (:class:`~tokencake.serving.kvcore.wire.CopyJob`, from ``build_jobs``) and
learns how they went from a :class:`~tokencake.serving.kvcore.wire.CopyReport`
(``on_worker_meta``). A copy of ``n`` blocks takes the hardware profile's
``copy_s(direction, n)``:

* on the CPU backend (``copies_async`` false) every copy runs inside the step that ships it, on
  the cores that run the forward: the step lasts that much longer;
* on a GPU a demand load also runs inside its step (the forward reads its blocks), while saves
  (D2H) and prefetches (H2D) each run on a side stream of their own beside compute, as the
  connector's copy lanes do: a copy starts when the previous one of its direction is done, and
  neither direction waits for the other. A copy that starts while the other direction's lane is
  busy takes ``1 / profile.duplex_share`` as long (both directions share the link; measured on an
  H200 at ~91 % of the sum of each alone), and the engine lengthens a step that runs while a
  side-stream copy is in flight by ``profile.copy_compute_slowdown``.

Each job is reported exactly once, after the first step (or idle step) that ends once it is done,
as ``JobResult(ok=True, seconds=<its copy time>, nbytes=<its bytes>)`` — late when that is past
its ``timeout_s``, as a worker flags it. An ``invalid`` job (the core lost its plan) copies
nothing and is never reported, as a worker reports its blocks as failed loads instead (the
simulator models no failed copy).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from tokencake.serving.kvcore.wire import DEFAULT_JOB_TIMEOUT_S, CopyJob, JobResult
from tokencake.sim.profiles import HardwareProfile

__all__ = ["CopyEngine", "Report"]


@dataclass(frozen=True)
class Report:
    """One step's finished copies (a :class:`~tokencake.serving.kvcore.wire.CopyReport`)."""

    results: Mapping[int, JobResult] = field(default_factory=dict)
    disabled: str | None = None


@dataclass
class _Copy:
    job: CopyJob
    issued_at: float
    #: When the copy is done (-inf: with the step that shipped it).
    done_at: float
    seconds: float
    nbytes: int


class CopyEngine:
    """Runs the core's copy jobs in the profile's time; see the module docstring."""

    def __init__(self, profile: HardwareProfile) -> None:
        self.profile = profile
        #: When each side stream is next free (GPU only).
        self._lane_free_at = {"d2h": 0.0, "h2d": 0.0}
        self._copies: list[_Copy] = []

    def submit(self, jobs: list[CopyJob], now: float) -> float:
        """Start the step's jobs at ``now`` (the step's start); returns the seconds they add to
        the step (the copies that run inside it)."""
        in_step = 0.0
        for job in jobs:
            if job.invalid:
                continue
            blocks = len(job.device_blocks)
            seconds = self.profile.copy_s(job.direction, blocks)
            if job.kind == "load" or not self.profile.copies_async:
                in_step += seconds
                done_at = -math.inf
            else:
                start = max(self._lane_free_at[job.direction], now)
                other = "h2d" if job.direction == "d2h" else "d2h"
                if self._lane_free_at[other] > start:
                    seconds /= self.profile.duplex_share
                done_at = self._lane_free_at[job.direction] = start + seconds
            self._copies.append(_Copy(job, now, done_at, seconds, blocks * self.profile.block_bytes))
        return in_step

    def report(self, now: float) -> Report | None:
        """The copies done by ``now`` (the end of a step), in the order they finished; each once."""
        done = [c for c in self._copies if c.done_at <= now]
        if not done:
            return None
        self._copies = [c for c in self._copies if c.done_at > now]
        done.sort(key=lambda c: c.done_at)  # stable: a step's copies in the order they shipped
        results = {}
        for c in done:
            timeout = c.job.timeout_s if c.job.timeout_s is not None else DEFAULT_JOB_TIMEOUT_S
            finished = c.issued_at + c.seconds if c.done_at == -math.inf else c.done_at
            late = finished - c.issued_at > timeout
            results[c.job.job_id] = JobResult(True, c.seconds, c.nbytes, late=late)
        return Report(results)

    def side_busy(self, now: float) -> bool:
        """A side-stream copy is in flight after ``now``."""
        return any(t > now for t in self._lane_free_at.values())

    def next_done_at(self) -> float | None:
        """When the next side-stream copy is done (None: none is in flight)."""
        return min((c.done_at for c in self._copies), default=None)

    @property
    def busy(self) -> bool:
        """Copies are in flight."""
        return bool(self._copies)
