"""What the scheduler-side connector tells the workers each step, and what they answer.

Both classes cross a process boundary (EngineCore → worker and back, pickled by vLLM's
executor), so they hold plain ints, strings and lists only.
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

    @property
    def direction(self) -> Literal["d2h", "h2d"]:
        return "d2h" if self.kind == "offload" else "h2d"


@dataclass
class TokenCakeMetadata(KVConnectorMetadata):
    """The copies the workers must submit this step (in list order)."""

    jobs: list[CopyJob] = field(default_factory=list)


@dataclass
class JobResult:
    """A finished copy as seen by one or more workers."""

    ok: bool
    seconds: float
    nbytes: int
    error: str | None = None
    #: How many workers reported it (the scheduler waits for all of them).
    workers: int = 1


@dataclass
class TokenCakeWorkerMeta(KVConnectorWorkerMetadata):
    """Copies that finished on the worker since its last report (job id → result)."""

    results: dict[int, JobResult] = field(default_factory=dict)

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
                )
        return TokenCakeWorkerMeta(merged)

    def __bool__(self) -> bool:
        return bool(self.results)


__all__ = ["CopyJob", "JobKind", "JobResult", "TokenCakeMetadata", "TokenCakeWorkerMeta"]
