"""The copy jobs the KV core plans and the results a copy engine reports back.

Plain ints, strings and lists only: in the vLLM backend they cross a process boundary (EngineCore
→ workers and back, pickled by vLLM's executor); the simulator's timed copy engine consumes the
same objects. Every field added after the first version has a default, so either side may be
older than the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["DEFAULT_JOB_TIMEOUT_S", "CopyJob", "CopyReport", "JobKind", "JobResult"]

#: ``offload``: device → host at stall begin. ``prefetch``: host → device before the predicted
#: return. ``load``: host → device for a request being scheduled this step (demand load).
JobKind = Literal["offload", "prefetch", "load"]

#: The core's default wait for a job's report (``Options.job_timeout_s``).
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
    #: Copy nothing; report ``device_blocks`` as failed loads (the core lost its plan).
    invalid: bool = False
    #: Seconds after which the core stops waiting for this job (None: the default above). The
    #: copy engine uses it to flag late reports and, for a core that releases the job's blocks at
    #: that point, to fence the copy before any later forward.
    timeout_s: float | None = None

    @property
    def direction(self) -> Literal["d2h", "h2d"]:
        return "d2h" if self.kind == "offload" else "h2d"


@dataclass
class JobResult:
    """A finished copy as seen by one or more copy engines (workers).

    Each engine reports each job it accepted exactly once, and only when the copy can no longer
    touch device blocks or host slots (complete, failed before submission, or its partial
    submission complete): after that report the core may reuse them.
    """

    ok: bool
    seconds: float
    nbytes: int
    error: str | None = None
    #: How many workers reported it (the core waits for all of them).
    workers: int = 1
    #: Reported after the job's ``timeout_s`` (the core may have given up on it already).
    late: bool = False


class CopyReport(Protocol):
    """What the copy engines report after a step: finished jobs, and why they cannot copy at all."""

    @property
    def results(self) -> Mapping[int, JobResult]: ...

    @property
    def disabled(self) -> str | None: ...
