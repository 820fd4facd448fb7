"""What the scheduler-side connector tells the workers each step, and what they answer.

Both classes cross a process boundary (EngineCore → worker and back, pickled by vLLM's
executor), so they hold plain ints, strings and lists only. Every field added after the first
version has a default, so either side may be older than the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

#: ``offload``: device → host at stall begin. ``prefetch``: host → device before the predicted
#: return. ``load``: host → device for a request being scheduled this step (demand load).
JobKind = Literal["offload", "prefetch", "load"]

#: The scheduler's default wait for a job's report (``Options.job_timeout_s``).
DEFAULT_JOB_TIMEOUT_S = 60.0


@dataclass
class CopyJob:
    """One block copy. ``device_blocks[i]`` pairs with ``host_slots[i]``."""

    job_id: int
    kind: JobKind
    device_blocks: list[int]
    host_slots: list[int]
    #: The request a demand load feeds (its forward this step reads the blocks).
    req_id: str | None = None
    #: Copy nothing; report ``device_blocks`` as failed loads (the scheduler lost its plan).
    invalid: bool = False
    #: Seconds after which the scheduler stops waiting for this job (None: the default above).
    #: The worker uses it to flag late reports and, for a scheduler that releases the job's
    #: blocks at that point, to fence the copy before any later forward (see ``worker.py``).
    timeout_s: float | None = None

    @property
    def direction(self) -> Literal["d2h", "h2d"]:
        return "d2h" if self.kind == "offload" else "h2d"


@dataclass
class TokenCakeMetadata(KVConnectorMetadata):
    """The copies the workers must submit this step (in list order)."""

    jobs: list[CopyJob] = field(default_factory=list)
    #: True when the scheduler keeps a timed-out job's blocks and host slots until every worker
    #: has reported that job (the handshake). False (older schedulers): it releases them at the
    #: timeout, so the worker fences copies that old before the next forward.
    release_after_report: bool = False


@dataclass
class JobResult:
    """A finished copy as seen by one or more workers.

    A worker reports each job it accepted exactly once, and only when the copy can no longer
    touch device blocks or host slots (complete, failed before submission, or its partial
    submission complete): after that report the scheduler may reuse them.
    """

    ok: bool
    seconds: float
    nbytes: int
    error: str | None = None
    #: How many workers reported it (the scheduler waits for all of them).
    workers: int = 1
    #: Reported after the job's ``timeout_s`` (the scheduler may have given up on it already).
    late: bool = False


@dataclass
class TokenCakeWorkerMeta(KVConnectorWorkerMetadata):
    """Copies that finished on the worker since its last report (job id → result).

    ``disabled`` is set when the worker cannot copy at all (host pool allocation failed, a KV
    layout it cannot map): every job will fail, so the scheduler should stop planning them.
    """

    results: dict[int, JobResult] = field(default_factory=dict)
    disabled: str | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge another worker's report: a job is ok only if every worker's copy was ok."""
        if not isinstance(other, TokenCakeWorkerMeta):
            return self
        merged = dict(self.results)
        for job_id, res in other.results.items():
            mine = merged.get(job_id)
            if mine is None:
                merged[job_id] = res
            else:
                merged[job_id] = JobResult(
                    ok=mine.ok and res.ok,
                    seconds=max(mine.seconds, res.seconds),
                    nbytes=mine.nbytes + res.nbytes,
                    error=mine.error or res.error,
                    workers=mine.workers + res.workers,
                    late=mine.late or res.late,
                )
        return TokenCakeWorkerMeta(merged, self.disabled or other.disabled)

    def __bool__(self) -> bool:
        return bool(self.results) or self.disabled is not None


__all__ = [
    "DEFAULT_JOB_TIMEOUT_S",
    "CopyJob",
    "JobKind",
    "JobResult",
    "TokenCakeMetadata",
    "TokenCakeWorkerMeta",
]
