"""The timed copy engine (tokencake/sim/copies.py): the profile's copy time, where copies run, one
report per job."""

from __future__ import annotations

import pytest

from tokencake.serving.kvcore.wire import CopyJob
from tokencake.sim.copies import CopyEngine
from tokencake.sim.profiles import get_profile

GPU = get_profile("h200-llama3-8b")
CPU = get_profile("cpu-measured")


def job(job_id: int, kind: str, blocks: int, timeout_s: float | None = None) -> CopyJob:
    ids = list(range(blocks))
    return CopyJob(job_id, kind, ids, ids, timeout_s=timeout_s)  # type: ignore[arg-type]


def test_on_a_gpu_saves_and_prefetches_run_on_a_lane_each_beside_the_step() -> None:
    """As the connector's copy lanes (measured on an H200: D2H and H2D run at once, sharing the
    link): a prefetch issued while a save is copying starts at once at the duplex share of its rate,
    saves queue behind saves, and neither adds to the step; a demand load does."""
    copies = CopyEngine(GPU)
    assert 0.85 < GPU.duplex_share < 1.0
    in_step = copies.submit([job(1, "offload", 32), job(2, "prefetch", 8), job(3, "offload", 4)], now=10.0)
    assert in_step == 0.0
    assert copies.side_busy(10.0)
    done = {c.job.job_id: c.done_at for c in copies._copies}
    assert done[2] == pytest.approx(10.0 + GPU.copy_s("h2d", 8) / GPU.duplex_share)
    assert done[1] == pytest.approx(10.0 + GPU.copy_s("d2h", 32))
    assert done[2] < done[1]  # the next save starts alone on the link: its full rate
    assert done[3] == pytest.approx(done[1] + GPU.copy_s("d2h", 4))
    assert copies.submit([job(4, "load", 3)], now=10.0) == pytest.approx(GPU.copy_s("h2d", 3))
    assert copies.next_done_at() == -float("inf")  # the load: done with its step
    first = copies.report(done[2])
    assert first is not None and list(first.results) == [4, 2]  # the load, then the prefetch
    assert copies.next_done_at() == pytest.approx(done[1])
    rest = copies.report(done[3])
    assert rest is not None and list(rest.results) == [1, 3] and not copies.busy
    assert not copies.side_busy(done[3])
    assert copies.report(done[3] + 1.0) is None  # each job is reported once


def test_on_the_cpu_every_copy_runs_inside_its_step() -> None:
    copies = CopyEngine(CPU)
    jobs = [job(1, "offload", 2), job(2, "prefetch", 1), job(3, "load", 1)]
    assert copies.submit(jobs, now=0.0) == pytest.approx(
        CPU.copy_s("d2h", 2) + CPU.copy_s("h2d", 1) + CPU.copy_s("h2d", 1)
    )
    report = copies.report(0.5)
    assert report is not None and list(report.results) == [1, 2, 3]
    res = report.results[1]
    assert res.ok and res.seconds == pytest.approx(CPU.copy_s("d2h", 2)) and res.nbytes == 2 * CPU.block_bytes


def test_a_copy_past_its_timeout_is_reported_late_and_an_invalid_job_copies_nothing() -> None:
    copies = CopyEngine(GPU)
    copies._lane_free_at["d2h"] = 100.0  # the lane is busy for a long time
    copies.submit([job(1, "offload", 1, timeout_s=60.0), CopyJob(0, "load", [5], [], "r", invalid=True)], 0.0)
    report = copies.report(200.0)
    assert report is not None and list(report.results) == [1] and report.results[1].late
