"""The fault knob (``TOKENCAKE_FAULTS``) and a held-back copy, on their own; the worker's use of
them (failed and stalled jobs end to end) is in ``test_worker.py`` and ``test_worker_faults.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tokencake.serving.vllm._copy_backend import CopySubmitError
from tokencake.serving.vllm.faults import FAULTS_ENV, Faults, StalledCopy, parse_faults
from tokencake.serving.vllm.worker import WorkerSide


def test_fault_knob_parsing() -> None:
    assert parse_faults("") is None and parse_faults(" , ") is None
    f = parse_faults("copy_fail=0.2, copy_stall_s=0.5, seed=1")
    assert f == Faults(copy_fail=0.2, copy_stall=1.0, copy_stall_s=0.5, seed=1)
    f = parse_faults("copy_stall=0.25,copy_stall_s=2,kinds=offload+prefetch")
    assert f is not None and f.copy_stall == 0.25 and f.kinds == {"offload", "prefetch"} and f.active
    assert not parse_faults("seed=3").active  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "text",
    [
        "copy_fail=2",
        "copy_fail=-0.1",
        "copy_fail=nan",
        "copy_fail=abc",
        "copy_stall_s=inf",
        "copy_stall_s=99999",
        "copy_fial=0.1",
        "copy_fail",
        "copy_fail=",
        "=0.1",
        "copy_fail=0.1,copy_fail=0.2",
        "kinds=load+teleport",
        "seed=1.5",
    ],
)
def test_bad_fault_knob_warns_once_and_injects_nothing(
    text: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError):
        parse_faults(text)
    monkeypatch.setenv(FAULTS_ENV, text)
    with caplog.at_level("WARNING", logger="vllm.tokencake.worker"):
        w = WorkerSide(10, 4)
    assert w.faults is None
    (rec,) = caplog.records
    assert FAULTS_ENV in rec.getMessage() and "ignoring" in rec.getMessage()


# ------------------------------------------------------------------ a held-back copy


class _Clock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class _Copy:
    """A submitted copy that is done at once."""

    nbytes = 64
    seconds = 0.25

    def __init__(self) -> None:
        self.waited = self.ordered = 0

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        self.waited += 1

    def order_before_compute(self) -> None:
        self.ordered += 1


def test_a_stalled_copy_is_submitted_once_when_it_is_due() -> None:
    clock, copy, submits = _Clock(), _Copy(), []

    def submit() -> _Copy:
        submits.append(clock.t)
        return copy

    stalled = StalledCopy(submit, 12.0, 64, clock, clock.sleep)
    assert not stalled.done() and submits == [] and stalled.seconds == 0.0  # nothing written yet
    clock.t = 12.0
    assert stalled.done() and stalled.done() and submits == [12.0]
    assert stalled.seconds == 0.25 and stalled.nbytes == 64 and stalled.error is None


def test_ordering_a_stalled_copy_first_waits_until_it_is_due() -> None:
    clock, copy = _Clock(), _Copy()
    stalled = StalledCopy(lambda: copy, 11.5, 64, clock, clock.sleep)
    stalled.order_before_compute()
    assert clock.t == pytest.approx(11.5) and copy.waited == 1 and copy.ordered == 1


def test_a_stalled_copy_whose_submit_fails_half_way_keeps_the_queued_part() -> None:
    clock, partial = _Clock(), _Copy()

    def submit() -> _Copy:
        raise CopySubmitError("RuntimeError: CUDA out of memory", partial)  # type: ignore[arg-type]

    stalled = StalledCopy(submit, 10.0, 64, clock, clock.sleep)
    assert stalled.done()  # the queued part has run
    assert stalled.error == "CopySubmitError: RuntimeError: CUDA out of memory"
