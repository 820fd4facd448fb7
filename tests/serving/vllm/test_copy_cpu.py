"""The CPU copy backend: a copy is complete and timed when ``run`` returns; a failure is raised
as it is (nothing can still be queued, so it is not a :class:`CopySubmitError`)."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from tokencake.serving.vllm._copy_backend import CopyHandle, CopySubmitError  # noqa: E402
from tokencake.serving.vllm._copy_cpu import CpuBackend  # noqa: E402


def _handle() -> CopyHandle:
    return CopyHandle("h2d", 1, 64, time.perf_counter(), "load")


def test_a_cpu_lane_has_no_stream_and_its_staging_only_when_asked() -> None:
    backend = CpuBackend(torch, torch.device("cpu"))
    plain = backend.make_lane("load", 0, 64)
    assert plain.stream is None and plain.staging is None and plain.index is None
    staged = backend.make_lane("offload", 3, 64)
    assert staged.stream is None and staged.staging is not None and staged.index is not None
    assert staged.staging.numel() == 3 * 64 and staged.staging.dtype == torch.uint8
    assert staged.index.numel() == 3 and staged.index.dtype == torch.int64


def test_a_cpu_copy_is_complete_and_timed_when_run_returns() -> None:
    backend = CpuBackend(torch, torch.device("cpu"))
    src, dst = torch.arange(1 << 16, dtype=torch.float32), torch.zeros(1 << 16)
    handle = _handle()
    assert backend.run(handle, backend.make_lane("load", 0, 64), lambda: dst.copy_(src)) is handle
    assert torch.equal(dst, src) and handle.done() and handle.seconds > 0
    handle.wait()  # nothing to wait for
    handle.order_before_compute()  # nor to order: the copy has run


def test_a_failed_cpu_copy_raises_its_own_error() -> None:
    backend = CpuBackend(torch, torch.device("cpu"))

    def boom() -> None:
        raise IndexError("device block 99 out of range")

    with pytest.raises(IndexError, match="out of range") as err:
        backend.run(_handle(), backend.make_lane("load", 0, 64), boom)
    assert not isinstance(err.value, CopySubmitError)
