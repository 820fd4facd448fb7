"""Worker-side job execution on CPU tensors: round trips, failure reporting, result aggregation."""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from tokencake.serving.vllm.faults import FAULTS_ENV, Faults  # noqa: E402
from tokencake.serving.vllm.metadata import (  # noqa: E402
    CopyJob,
    JobResult,
    TokenCakeMetadata,
    TokenCakeWorkerMeta,
)
from tokencake.serving.vllm.worker import WorkerSide  # noqa: E402


def _worker(num_blocks: int = 10, host: int = 4) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    caches = {f"l{i}": torch.randn((num_blocks, 2, 8, 4), generator=gen).to(torch.bfloat16) for i in range(2)}
    w = WorkerSide(num_blocks, host)
    w.register_kv_caches(caches)
    return w, caches


def test_offload_then_load_round_trip() -> None:
    w, caches = _worker()
    before = {k: v.clone() for k, v in caches.items()}
    w.start_jobs(TokenCakeMetadata([CopyJob(1, "offload", [2, 3], [0, 1])]))
    w.start_saves()
    res = w.take_results()
    assert res is not None and res.results[1].ok and res.results[1].nbytes == 2 * w.copier.block_bytes
    assert w.take_results() is None  # reported once
    w.start_jobs(TokenCakeMetadata([CopyJob(2, "load", [7, 8], [0, 1], req_id="r")]))
    for name, t in caches.items():
        assert torch.equal(t[7], before[name][2]) and torch.equal(t[8], before[name][3])
    assert w.take_results().results[2].ok
    assert w.take_load_errors() == set()


def test_failed_load_is_reported_by_block_and_job() -> None:
    w, _ = _worker()
    w.start_jobs(TokenCakeMetadata([CopyJob(5, "load", [1, 99], [0, 1], req_id="r")]))
    res = w.take_results()
    assert res is not None and not res.results[5].ok and "IndexError" in (res.results[5].error or "")
    assert w.take_load_errors() == {1, 99}
    assert w.take_load_errors() == set()


def test_invalid_job_copies_nothing_and_reports_blocks() -> None:
    w, caches = _worker()
    before = caches["l0"].clone()
    w.start_jobs(TokenCakeMetadata([CopyJob(0, "load", [4, 5], [], req_id="r", invalid=True)]))
    assert w.take_load_errors() == {4, 5}
    assert torch.equal(caches["l0"], before)


def test_same_job_is_never_run_twice() -> None:
    w, _ = _worker()
    meta = TokenCakeMetadata([CopyJob(9, "offload", [1], [0])])
    w.start_jobs(meta)
    w.start_saves()
    w.take_results()
    w.start_jobs(meta)
    w.start_saves()
    assert w.take_results() is None


def test_no_host_pool_fails_jobs_instead_of_raising() -> None:
    w = WorkerSide(10, 4)
    w.register_kv_caches({})  # allocation fails: no tensors
    assert w.error
    w.start_jobs(TokenCakeMetadata([CopyJob(1, "load", [1], [0], req_id="r")]))
    assert not w.take_results().results[1].ok
    assert w.take_load_errors() == {1}


def test_worker_meta_aggregates_across_workers() -> None:
    a = TokenCakeWorkerMeta({1: JobResult(True, 0.1, 10), 2: JobResult(True, 0.2, 10)})
    b = TokenCakeWorkerMeta({1: JobResult(False, 0.3, 10, "boom")})
    merged = a.aggregate(b)
    assert isinstance(merged, TokenCakeWorkerMeta)
    assert merged.results[1] == JobResult(False, 0.3, 20, "boom", workers=2)
    assert merged.results[2].workers == 1
    assert not TokenCakeWorkerMeta() and bool(a)


def test_offloads_copy_after_the_forward_not_before() -> None:
    """Regression (stale KV): a block hashed this step holds its KV only after the step's forward.

    ``start_load_kv`` runs before the forward in a step with synchronous loads; an offload started
    there copies whatever the block held before, and that copy would be committed under the hash.
    """
    w, caches = _worker()
    meta = TokenCakeMetadata(
        [CopyJob(1, "load", [6], [3], req_id="r"), CopyJob(2, "offload", [2, 3], [0, 1])]
    )
    w.start_jobs(meta)  # start_load_kv, before the forward (the step has a demand load)
    assert w.busy
    forward = {k: torch.full_like(v[2:4], 7.0) for k, v in caches.items()}
    for k, t in caches.items():  # the forward writes the freshly allocated blocks
        t[2:4] = forward[k]
    w.start_saves()  # wait_for_save, after the forward
    res = w.take_results()
    assert res is not None and res.results[1].ok and res.results[2].ok
    for host, k in zip(w.copier.host_tensors, caches, strict=True):
        assert torch.equal(host[0:2], forward[k]), "the host copy must hold what the forward computed"


# ------------------------------------------------------------------ one bad job fails alone


class FakeHandle:
    """A copy that completes when told to; ``done()`` may raise (a CUDA event query gone bad)."""

    def __init__(self, *, nbytes: int = 8, raises: Exception | None = None) -> None:
        self.nbytes = nbytes
        self.finished = False
        self.raises = raises
        self.ordered = 0
        self.waited = 0

    def done(self) -> bool:
        if self.raises is not None:
            raise self.raises
        return self.finished

    def wait(self) -> None:
        self.waited += 1
        self.finished = True

    def order_before_compute(self) -> None:
        self.ordered += 1

    @property
    def seconds(self) -> float:
        return 0.01


def _quiet_worker(**kw: object) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    caches = {f"l{i}": torch.randn((10, 2, 8, 4), generator=gen).to(torch.bfloat16) for i in range(2)}
    w = WorkerSide(10, 4, faults=Faults(), **kw)  # type: ignore[arg-type]
    w.register_kv_caches(caches)
    return w, caches


def test_one_bad_job_fails_alone_and_the_others_proceed() -> None:
    w, caches = _quiet_worker()
    before = caches["l0"].clone()
    bad_kind = CopyJob(4, "load", [5], [0], req_id="r")
    bad_kind.kind = "teleport"  # type: ignore[assignment]
    meta = TokenCakeMetadata(
        [
            CopyJob(1, "load", [1, 99], [0, 1], req_id="r"),  # device id out of range
            CopyJob(2, "load", None, [0], req_id="r"),  # type: ignore[arg-type]  # garbage list
            CopyJob(3, "prefetch", [2, 3], [2, 3]),
            bad_kind,
            CopyJob(5, "offload", [6], ["x"]),  # type: ignore[list-item]  # garbage slot
            CopyJob(6, "offload", [7], [1]),
        ]
    )
    w.start_jobs(meta)
    w.start_saves()
    res = w.take_results()
    assert res is not None
    assert {j: r.ok for j, r in res.results.items()} == {
        1: False,
        2: False,
        3: True,
        4: False,
        5: False,
        6: True,
    }
    assert w.take_load_errors() == {1, 99}  # the integer ids of the failed demand load
    assert torch.equal(caches["l0"][[0, 1, 4, 5, 6, 7, 8, 9]], before[[0, 1, 4, 5, 6, 7, 8, 9]])


def test_event_query_that_raises_fails_only_its_job(monkeypatch: pytest.MonkeyPatch) -> None:
    w, _ = _quiet_worker()
    handles = {
        1: FakeHandle(raises=RuntimeError("CUDA error: an illegal memory access")),
        2: FakeHandle(),
        3: FakeHandle(),
    }
    calls = iter(handles.values())
    monkeypatch.setattr(w.copier, "copy", lambda *a, **k: next(calls))
    w.start_jobs(
        TokenCakeMetadata(
            [
                CopyJob(1, "load", [1], [0], req_id="r"),
                CopyJob(2, "prefetch", [2], [1]),
                CopyJob(3, "prefetch", [3], [2]),
            ]
        )
    )
    handles[2].finished = True
    res = w.take_results()
    assert res is not None and not res.results[1].ok and "illegal memory" in (res.results[1].error or "")
    assert res.results[2].ok and 3 not in res.results  # job 3 is still running, not lost
    assert w.take_load_errors() == {1}
    handles[3].finished = True
    assert w.take_results().results[3].ok


def test_hooks_survive_garbage_metadata() -> None:
    w, _ = _quiet_worker()
    w.start_jobs(TokenCakeMetadata(None))  # type: ignore[arg-type]
    w.start_jobs(object())  # type: ignore[arg-type]
    w.before_forward(object())  # type: ignore[arg-type]
    w.start_saves()
    assert w.take_results() is None and w.take_load_errors() == set()
    assert w.counters.get("errors.start_jobs") == 2


def test_a_copy_that_failed_half_way_is_reported_when_its_queued_part_has_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tokencake.serving.vllm._copy_backend import CopySubmitError

    w, _ = _quiet_worker()
    partial = FakeHandle()

    def fail_half_way(*a: object, **k: object) -> None:
        raise CopySubmitError("RuntimeError: CUDA out of memory", partial)  # type: ignore[arg-type]

    monkeypatch.setattr(w.copier, "copy", fail_half_way)
    w.start_jobs(TokenCakeMetadata([CopyJob(1, "load", [4, 5], [0, 1], req_id="r")]))
    assert partial.ordered == 1  # the forward still waits for what was queued
    assert w.take_load_errors() == {4, 5}  # vLLM recomputes these tokens
    assert w.take_results() is None  # not reported while the queued part may still write
    partial.finished = True
    res = w.take_results()
    assert res is not None and not res.results[1].ok and "out of memory" in (res.results[1].error or "")


def test_load_that_cannot_be_stream_ordered_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    w, _ = _quiet_worker()
    h = FakeHandle()

    def broken_order() -> None:
        raise RuntimeError("no current stream")

    h.order_before_compute = broken_order  # type: ignore[method-assign]
    monkeypatch.setattr(w.copier, "copy", lambda *a, **k: h)
    w.start_jobs(TokenCakeMetadata([CopyJob(1, "load", [4], [0], req_id="r")]))
    assert h.waited == 1  # blocked until the copy was done instead
    res = w.take_results()
    assert res is not None and not res.results[1].ok
    assert w.take_load_errors() == {4}


def test_a_load_whose_wait_also_fails_is_reported_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither stream order nor a blocking wait worked: the job stays in flight and is reported
    once, when its copy has run — a second report would count as another rank's."""
    w, _ = _quiet_worker()
    h = FakeHandle()

    def broken() -> None:
        raise RuntimeError("stream gone")

    h.order_before_compute = broken  # type: ignore[method-assign]
    h.wait = broken  # type: ignore[method-assign]
    monkeypatch.setattr(w.copier, "copy", lambda *a, **k: h)
    w.start_jobs(TokenCakeMetadata([CopyJob(1, "load", [4], [0], req_id="r")]))
    assert w.take_load_errors() == {4}
    assert w.take_results() is None  # the copy may still be writing block 4
    h.finished = True
    res = w.take_results()
    assert res is not None and not res.results[1].ok and "stream gone" in (res.results[1].error or "")
    assert w.take_results() is None


def test_each_kind_copies_on_its_own_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    w, _ = _quiet_worker()
    lanes: list[str] = []
    real = w.copier.copy

    def spy(direction: str, blocks: list[int], slots: list[int], *, lane: str) -> object:
        lanes.append(lane)
        return real(direction, blocks, slots, lane=lane)  # type: ignore[arg-type]

    monkeypatch.setattr(w.copier, "copy", spy)
    w.start_jobs(
        TokenCakeMetadata(
            [
                CopyJob(1, "load", [1], [0], req_id="r"),
                CopyJob(2, "prefetch", [2], [1]),
                CopyJob(3, "offload", [3], [2]),
            ]
        )
    )
    w.start_saves()
    assert lanes == ["load", "prefetch", "offload"]


# ------------------------------------------------------------------ copies disabled at init


def test_unmappable_kv_layout_disables_copies_and_tells_the_scheduler() -> None:
    w = WorkerSide(10, 4, faults=Faults())
    w.register_kv_caches({"l0": torch.zeros((25, 2, 8, 4))})  # 25 is no multiple of 10 blocks
    assert w.disabled is not None and "GeometryError" in w.disabled
    first = w.take_results()
    assert first is not None and first.disabled == w.disabled and not first.results
    assert bool(first)  # vLLM forwards it (a falsy meta would be dropped)
    assert w.take_results() is None  # said once ...
    w.start_jobs(TokenCakeMetadata([CopyJob(1, "prefetch", [1], [0])]))
    again = w.take_results()
    assert (
        again is not None and not again.results[1].ok and again.disabled == w.disabled
    )  # ... and with results
    merged = TokenCakeWorkerMeta({1: JobResult(True, 0.1, 8)}).aggregate(again)
    assert isinstance(merged, TokenCakeWorkerMeta) and merged.disabled == w.disabled


def test_kernel_blocks_smaller_than_scheduler_blocks_still_copy() -> None:
    w = WorkerSide(10, 4, faults=Faults())
    cache = torch.arange(20 * 2 * 8 * 4, dtype=torch.float32).view(20, 2, 8, 4)  # 2 kernel blocks per block
    w.register_kv_caches({"l0": cache})
    assert w.disabled is None
    before = cache.clone()
    w.start_jobs(TokenCakeMetadata([CopyJob(1, "offload", [3], [0])]))
    w.start_saves()
    w.start_jobs(TokenCakeMetadata([CopyJob(2, "load", [7], [0], req_id="r")]))
    assert w.take_results().results.keys() == {1, 2}
    assert torch.equal(cache[14:16], before[6:8])


def test_empty_host_pool_turns_copies_off_quietly() -> None:
    w = WorkerSide(10, 0, faults=Faults())
    w.register_kv_caches({"l0": torch.zeros((10, 2))})
    assert w.disabled == "host pool size is 0" and w.copier is None


# ------------------------------------------------------------------ timeouts: fence and handshake


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def _stalling_worker(stall_s: float) -> tuple[WorkerSide, dict[str, torch.Tensor], FakeClock]:
    clock = FakeClock()
    faults = Faults(copy_stall=1.0, copy_stall_s=stall_s)
    gen = torch.Generator().manual_seed(3)
    caches = {f"l{i}": torch.randn((10, 2, 8, 4), generator=gen) for i in range(2)}
    w = WorkerSide(10, 4, faults=faults, clock=clock, sleep=clock.sleep)
    w.register_kv_caches(caches)
    _clear_host(w)
    return w, caches, clock


def _clear_host(w: WorkerSide) -> None:
    """The host pool is ``torch.empty``: its bytes are whatever that memory held (NaNs, which
    compare unequal to themselves, or an earlier test's copy of the same seeded block)."""
    assert w.copier is not None
    for t in w.copier.host_tensors:
        t.zero_()


@pytest.mark.parametrize("kind", ["prefetch", "load"])
def test_a_held_back_copy_whose_submit_fails_half_way_waits_for_the_queued_part(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection holds a copy back; when it is submitted, part of it is queued before the
    submit fails. The job must not be reported (its device blocks freed) until that part ran."""
    from tokencake.serving.vllm._copy_backend import CopySubmitError

    w, _, clock = _stalling_worker(1.0)
    partial = FakeHandle()
    calls = {"n": 0}

    def fail_half_way(*a: object, **k: object) -> None:
        calls["n"] += 1
        raise CopySubmitError("RuntimeError: CUDA out of memory", partial)  # type: ignore[arg-type]

    monkeypatch.setattr(w.copier, "copy", fail_half_way)
    w.start_jobs(TokenCakeMetadata([CopyJob(1, kind, [4, 5], [0, 1], req_id="r", timeout_s=10.0)]))
    if kind == "prefetch":
        clock.t += 2.0
        assert w.take_results() is None  # submitted now, half queued: not reported yet
        partial.finished = True
    else:  # a load feeds this step's forward: held back, then waited for (the queued part ran)
        assert partial.waited == 1 and w.take_load_errors() == {4, 5}
    res = w.take_results()
    assert res is not None and not res.results[1].ok and "out of memory" in (res.results[1].error or "")
    assert calls["n"] == 1 and w.take_results() is None  # submitted once, reported once


def test_stalled_copy_writes_nothing_until_it_is_due() -> None:
    w, caches, clock = _stalling_worker(0.5)
    w.start_jobs(TokenCakeMetadata([CopyJob(1, "offload", [2], [0], timeout_s=10.0)]))
    w.start_saves()
    assert w.take_results() is None and w.busy
    assert not torch.equal(w.copier.host_tensors[0][0], caches["l0"][2])  # nothing written yet
    clock.t += 0.5
    res = w.take_results()
    assert res is not None and res.results[1].ok and not res.results[1].late
    assert torch.equal(w.copier.host_tensors[0][0], caches["l0"][2])
    assert w.counters["faults.copy_stall"] == 1


def test_old_scheduler_copies_are_fenced_before_the_next_forward() -> None:
    """A scheduler that frees a timed-out job's blocks (no handshake): the worker finishes a copy
    that old before the next forward, so a reused block is never written late."""
    w, _, clock = _stalling_worker(30.0)
    w.start_jobs(TokenCakeMetadata([CopyJob(1, "prefetch", [2], [0], timeout_s=4.0)]))
    clock.t += 1.9
    w.before_forward(TokenCakeMetadata())
    assert w.busy and "fenced" not in w.counters  # younger than half the timeout: left running
    clock.t += 0.2
    w.before_forward(TokenCakeMetadata())  # next step: 2.1 s old -> the forward waits for it
    assert w.counters["fenced"] == 1 and not w.busy
    res = w.take_results()
    assert res is not None and res.results[1].ok and res.results[1].late  # written, reported late
    assert clock.t == pytest.approx(130.0)  # the step really waited for the stalled copy


def test_handshake_scheduler_is_never_blocked_and_gets_a_late_report() -> None:
    w, _, clock = _stalling_worker(30.0)
    meta = TokenCakeMetadata([CopyJob(1, "offload", [2], [0], timeout_s=4.0)], release_after_report=True)
    w.start_jobs(meta)
    w.start_saves()
    for _ in range(10):
        clock.t += 2.0
        w.before_forward(TokenCakeMetadata(release_after_report=True))
        assert w.take_results() is None  # still running: no report, no fence, no wait
    assert "fenced" not in w.counters and clock.t == pytest.approx(120.0)
    clock.t += 10.0
    res = w.take_results()
    assert res is not None and res.results[1].ok and res.results[1].late


# ------------------------------------------------------------------ injected faults


def test_fault_knob_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(FAULTS_ENV, "copy_fail=1,kinds=load,seed=7")
    with caplog.at_level("WARNING", logger="vllm.tokencake.worker"):
        w = WorkerSide(10, 4)
    assert w.faults == Faults(copy_fail=1.0, kinds=frozenset({"load"}), seed=7)
    assert "fault injection ON" in caplog.text
    monkeypatch.delenv(FAULTS_ENV)
    assert WorkerSide(10, 4).faults is None


def test_injected_copy_failure_writes_nothing_and_reports_the_blocks() -> None:
    gen = torch.Generator().manual_seed(3)
    caches = {"l0": torch.randn((10, 2, 8, 4), generator=gen)}
    w = WorkerSide(10, 4, faults=Faults(copy_fail=1.0, kinds=frozenset({"load", "offload"})))
    w.register_kv_caches(caches)
    _clear_host(w)  # (this test was flaky in full-suite order: uninitialized host bytes can be NaN)
    before = caches["l0"].clone()
    host_before = w.copier.host_tensors[0].clone()
    w.start_jobs(
        TokenCakeMetadata(
            [
                CopyJob(1, "load", [3, 4], [0, 1], req_id="r"),
                CopyJob(2, "prefetch", [5], [2]),  # not an injected kind: copies
                CopyJob(3, "offload", [6], [3]),
            ]
        )
    )
    w.start_saves()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + 10.0
    while len(results) < 3 and time.monotonic() < deadline:  # the prefetch copy may finish later
        res = w.take_results()
        results.update(res.results if res is not None else {})
        time.sleep(0.01)
    seen = {j: (r.ok, r.error) for j, r in results.items()}
    assert {j: r.ok for j, r in results.items()} == {1: False, 2: True, 3: False}, (seen, w.counters)
    assert "injected" in (results[1].error or "")
    assert w.take_load_errors() == {3, 4}
    assert torch.equal(caches["l0"][[3, 4]], before[[3, 4]])
    assert torch.equal(w.copier.host_tensors[0][3], host_before[3])
    assert w.counters["faults.copy_fail"] == 2


def test_fault_draws_are_reproducible_with_a_seed() -> None:
    def outcomes(seed: int) -> list[bool]:
        w, _ = _quiet_worker()
        w.faults = Faults(copy_fail=0.5, seed=seed)
        w._rng.seed(seed)
        w.start_jobs(TokenCakeMetadata([CopyJob(i, "prefetch", [1], [0]) for i in range(1, 41)]))
        res = w.take_results()
        assert res is not None
        return [res.results[i].ok for i in range(1, 41)]

    a = outcomes(1)
    assert a == outcomes(1) and 5 < a.count(False) < 35
    assert a != outcomes(2)


def test_an_exception_that_cannot_even_be_printed_fails_its_job_only(monkeypatch: pytest.MonkeyPatch) -> None:
    class Unprintable(RuntimeError):
        def __str__(self) -> str:
            raise ValueError("no str for you")

    w, _ = _quiet_worker()
    real = w.copier.copy
    calls = iter([Unprintable(), None])

    def copy(*a: object, **k: object) -> object:
        exc = next(calls)
        if exc is not None:
            raise exc
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(w.copier, "copy", copy)
    w.start_jobs(
        TokenCakeMetadata(
            [CopyJob(1, "load", [1], [0], req_id="r"), CopyJob(2, "load", [2], [1], req_id="r")]
        )
    )
    res = w.take_results()
    assert res is not None and res.results[1].error == "Unprintable" and res.results[2].ok
    assert w.take_load_errors() == {1}
