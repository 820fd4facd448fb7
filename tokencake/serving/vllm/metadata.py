"""What the scheduler-side connector tells the workers each step, and what they answer (vLLM's
metadata classes around the KV core's plain copy jobs and results: ``kvcore/wire.py``).

Both classes cross a process boundary (EngineCore → worker and back, pickled by vLLM's
executor), so they hold plain ints, strings and lists only. Every field added after the first
version has a default, so either side may be older than the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from tokencake.serving.kvcore.wire import DEFAULT_JOB_TIMEOUT_S, CopyJob, JobKind, JobResult


@dataclass
class TokenCakeMetadata(KVConnectorMetadata):
    """The copies the workers must submit this step (in list order)."""

    jobs: list[CopyJob] = field(default_factory=list)
    #: True when the scheduler keeps a timed-out job's blocks and host slots until every worker
    #: has reported that job (the handshake). False (older schedulers): it releases them at the
    #: timeout, so the worker fences copies that old before the next forward.
    release_after_report: bool = False


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
