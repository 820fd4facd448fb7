"""Copy jobs in flight on their own: one report per job, only once its copy has run; late flags;
the fence for a scheduler without the handshake; failures reported by job and by block."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from tokencake.serving.vllm._inflight import Counters, InFlight, InFlightJobs
from tokencake.serving.vllm.metadata import CopyJob, JobResult


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Copy:
    """A copy that completes when told to; ordering it may fail."""

    nbytes = 64
    seconds = 0.5

    def __init__(self, *, order_fails: bool = False) -> None:
        self.finished = False
        self.order_fails = order_fails
        self.ordered = self.waited = 0

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.waited += 1
        self.finished = True

    def order_before_compute(self) -> None:
        if self.order_fails:
            raise RuntimeError("no current stream")
        self.ordered += 1


def _jobs() -> tuple[InFlightJobs, _Clock]:
    clock = _Clock()
    return InFlightJobs(clock, Counters()), clock


def test_a_job_is_reported_once_when_its_copy_has_run() -> None:
    jobs, clock = _jobs()
    copy = _Copy()
    jobs.add(InFlight(CopyJob(1, "prefetch", [2], [0], timeout_s=4.0), copy, clock.t))
    jobs.poll()
    assert jobs.finished == {} and 1 in jobs.inflight  # still running: not reported
    copy.finished = True
    clock.t += 1.0
    jobs.poll()
    assert jobs.finished == {1: JobResult(True, 0.5, 64)} and not jobs.inflight
    jobs.finished.clear()
    jobs.poll()
    assert jobs.finished == {}  # reported once


def test_a_report_after_the_jobs_timeout_is_flagged_late() -> None:
    jobs, clock = _jobs()
    copy = _Copy()
    jobs.add(InFlight(CopyJob(1, "offload", [2], [0], timeout_s=4.0), copy, clock.t, error="half queued"))
    clock.t += 4.5
    copy.finished = True
    jobs.poll()
    assert jobs.finished == {1: JobResult(False, 0.5, 0, "half queued", late=True)}
    assert jobs.counters["jobs.late"] == 1 and jobs.counters["jobs.failed"] == 1


def test_the_fence_orders_a_stale_copy_once_and_waits_where_it_cannot() -> None:
    jobs, clock = _jobs()
    young, stale = _Copy(), _Copy(order_fails=True)
    jobs.add(InFlight(CopyJob(1, "prefetch", [1], [0], timeout_s=10.0), young, clock.t + 3.0))
    jobs.add(InFlight(CopyJob(2, "prefetch", [2], [1], timeout_s=10.0), stale, clock.t))
    clock.t += 5.0  # job 2 is at half its timeout, job 1 below it
    jobs.fence_stale()
    assert stale.waited == 1 and young.ordered == young.waited == 0
    jobs.fence_stale()
    assert jobs.counters["fenced"] == 1 and stale.waited == 1  # fenced once


def test_a_failed_demand_load_is_reported_by_job_and_by_block(caplog: pytest.LogCaptureFixture) -> None:
    jobs, _ = _jobs()
    with caplog.at_level(logging.DEBUG, logger="vllm.tokencake.worker"):
        jobs.fail(CopyJob(3, "load", [4, "x", 5], [0, 1, 2], req_id="r"), RuntimeError("boom"))  # type: ignore[list-item]
        jobs.fail(CopyJob(4, "prefetch", [6], [3]), RuntimeError("asked for"), quiet=True)
    assert jobs.finished == {
        3: JobResult(False, 0.0, 0, "RuntimeError: boom"),
        4: JobResult(False, 0.0, 0, "RuntimeError: asked for"),
    }
    assert jobs.load_errors == {4, 5}  # the integer ids of the load only
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG]
    assert jobs.counters["jobs.failed"] == 2


def test_a_query_that_raises_fails_its_job_alone() -> None:
    jobs, clock = _jobs()

    class Broken(_Copy):
        def done(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access")

    bad, good = Broken(), _Copy()
    good.finished = True
    jobs.add(InFlight(CopyJob(1, "load", [1], [0], req_id="r"), bad, clock.t))
    jobs.add(InFlight(CopyJob(2, "load", [2], [1], req_id="r"), good, clock.t))
    jobs.poll()
    assert not jobs.finished[1].ok and "illegal memory" in (jobs.finished[1].error or "")
    assert jobs.finished[2].ok and jobs.load_errors == {1} and not jobs.inflight
