"""The worker's copy jobs from submission to their one report (completion polling, timeouts).

Every accepted job is reported exactly once, and only when its copy can no longer touch the
device blocks or host slots: complete, failed before anything was submitted, or (a CUDA copy
that failed half-way) once its queued part has run. That is the worker half of the job timeout
handshake: a scheduler that sets ``TokenCakeMetadata.release_after_report`` keeps a timed-out
job's blocks until this report arrives (TokenCake's own scheduler always does). For a scheduler
that releases them at the timeout instead, :meth:`InFlightJobs.fence_stale` fences every copy
older than half its ``timeout_s``: the next forward (and, through it, every later copy) waits
for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from tokencake.serving.vllm.metadata import DEFAULT_JOB_TIMEOUT_S, CopyJob, JobResult

log = logging.getLogger("vllm.tokencake.worker")

#: The copy job kinds a worker runs (one copy lane each).
JOB_KINDS = frozenset(("offload", "prefetch", "load"))


class SubmittedCopy(Protocol):
    """What the worker needs of a submitted copy (``CopyHandle`` or a stalled one)."""

    nbytes: int

    def done(self) -> bool: ...

    def wait(self) -> None: ...

    def order_before_compute(self) -> None: ...

    @property
    def seconds(self) -> float: ...


@dataclass
class InFlight:
    """An accepted job whose copy was submitted and may still touch its blocks."""

    job: CopyJob
    handle: SubmittedCopy
    received: float
    #: The copy failed after part of it was queued: reported failed once that part has run.
    error: str | None = None
    fenced: bool = False


def job_timeout(job: CopyJob) -> float:
    """Seconds the scheduler waits for ``job``'s report (its ``timeout_s``, else the default)."""
    t = job.timeout_s
    return float(t) if isinstance(t, (int, float)) and t > 0 else DEFAULT_JOB_TIMEOUT_S


def block_ids(blocks: Iterable[Any]) -> set[int]:
    """The integer ids of a (possibly malformed) block list."""
    try:
        return {b for b in blocks if isinstance(b, int)}
    except Exception:
        return set()


def describe(exc: BaseException) -> str:
    """``"<type>: <message>"``, the error text a failed job is reported with; never raises."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # an exception whose str() fails is still a failed job
        return type(exc).__name__


class Counters(dict[str, int]):
    """Event counts for logs and tests (``errors.<where>``, ``faults.*``, ``fenced``, ...)."""

    def count(self, name: str) -> None:
        self[name] = self.get(name, 0) + 1

    def count_error(self, where: str) -> None:
        """Count an exception being handled (call inside ``except``) and log it."""
        self.count(f"errors.{where}")
        log.exception("TokenCake worker: %s failed (ignored)", where)


class InFlightJobs:
    """Submitted copies until their report, the finished results and the failed demand loads.

    ``fail`` and ``poll`` never raise for a single job: a job whose copy or query raises is
    reported failed alone.
    """

    def __init__(self, clock: Callable[[], float], counters: Counters) -> None:
        self._clock = clock
        self.counters = counters
        #: Job id -> its copy, until the copy can no longer touch its blocks.
        self.inflight: dict[int, InFlight] = {}
        #: Job id -> result, until the worker hands them to the scheduler.
        self.finished: dict[int, JobResult] = {}
        #: Device blocks whose demand load failed, until :meth:`take_load_errors`.
        self.load_errors: set[int] = set()

    def add(self, rec: InFlight) -> None:
        self.inflight[rec.job.job_id] = rec

    def take_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out

    def fail(self, job: CopyJob, exc: BaseException, *, quiet: bool = False) -> None:
        """Report a job failed (by id, and by block for a demand load); never raises.

        ``quiet``: a failure asked for (fault injection), logged at debug level only.
        """
        self.counters.count("jobs.failed")
        try:
            error = describe(exc)
            job_id = getattr(job, "job_id", None)
            kind = getattr(job, "kind", None)
            if quiet:
                log.debug("TokenCake copy job %s (%s): %s", job_id, kind, error)
            else:
                log.warning("TokenCake copy job %s (%s) failed: %s", job_id, kind, error)
            if isinstance(job_id, int):
                self.finished[job_id] = JobResult(False, 0.0, 0, error)
            if kind == "load":
                self.load_errors.update(block_ids(getattr(job, "device_blocks", ())))
        except Exception:  # a job too broken to even describe: nothing to report it under
            self.counters.count("errors.fail")

    def poll(self) -> None:
        """Report every job whose copy has completed; a job whose query raises is failed alone."""
        now = self._clock()
        for job_id, rec in list(self.inflight.items()):
            try:
                if not rec.handle.done():
                    continue
                seconds, nbytes = float(rec.handle.seconds), int(rec.handle.nbytes)
            except Exception as exc:  # a failed copy is a failed job, never an exception into vLLM
                self.inflight.pop(job_id, None)
                self.fail(rec.job, exc)
                continue
            self.inflight.pop(job_id, None)
            late = now - rec.received > job_timeout(rec.job)
            if late:
                self.counters.count("jobs.late")
            error = rec.error or getattr(rec.handle, "error", None)
            if error is not None:
                self.counters.count("jobs.failed")
                self.finished[job_id] = JobResult(False, seconds, 0, error, late=late)
            else:
                self.finished[job_id] = JobResult(True, seconds, nbytes, late=late)

    def fence_stale(self) -> None:
        """Order every copy older than half its job's timeout before the next forward."""
        now = self._clock()
        for rec in list(self.inflight.values()):
            if rec.fenced or now - rec.received < 0.5 * job_timeout(rec.job):
                continue
            rec.fenced = True
            self.counters.count("fenced")
            log.warning(
                "TokenCake copy job %d (%s) still running after %.1f s; the next forward waits for it",
                rec.job.job_id,
                rec.job.kind,
                now - rec.received,
            )
            try:
                rec.handle.order_before_compute()
            except Exception:
                try:
                    rec.handle.wait()
                except Exception:
                    self.counters.count_error("fence")

    def wait_all(self) -> None:
        """Block until every copy in flight has run (best effort), then forget them."""
        for rec in list(self.inflight.values()):
            try:
                rec.handle.wait()
            except Exception:
                pass
        self.inflight.clear()


__all__ = [
    "JOB_KINDS",
    "Counters",
    "InFlight",
    "InFlightJobs",
    "SubmittedCopy",
    "block_ids",
    "describe",
    "job_timeout",
]
