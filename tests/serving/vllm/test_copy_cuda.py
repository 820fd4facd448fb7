"""The CUDA copy backend against mocked streams and events: one stream per lane, demand loads at
the highest priority, every copy ordered after the compute stream, a half-submitted copy's end
still recorded. (``scripts/gpu_check.py`` and ``scripts/gpu_overlap.py`` run it on a real GPU.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tokencake.serving.vllm._copy import BlockCopier  # noqa: E402
from tokencake.serving.vllm._copy_backend import LANES, CopySubmitError  # noqa: E402
from tokencake.serving.vllm._copy_cuda import CudaBackend  # noqa: E402

SCATTERED = [17, 3, 29, 8, 11, 12, 35, 0, 22, 5]


def _caches(num_blocks: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        f"layer.{i}": torch.randn((num_blocks, 2, 16, 8), generator=gen).to(torch.bfloat16) for i in range(3)
    }


class _Log(list):  # type: ignore[type-arg]
    pass


class _FakeStream:
    def __init__(self, name: str, priority: int, log: _Log) -> None:
        self.name, self.priority, self.log = name, priority, log

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))


class _FakeEvent:
    def __init__(self, log: _Log) -> None:
        self.log = log
        self.stream: str | None = None

    def record(self, stream: _FakeStream) -> None:
        self.stream = stream.name
        self.log.append(("record", stream.name))

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: _FakeEvent) -> float:
        return 2.0


class _FakeCuda:
    def __init__(self, log: _Log) -> None:
        self.log = log
        self.current = _FakeStream("compute", 0, log)
        outer = self

        class Stream(_FakeStream):
            @staticmethod
            def priority_range() -> tuple[int, int]:
                return 0, -5  # (lowest, highest): lower numbers run first

            def __init__(self, device: object = None, priority: int = 0) -> None:
                super().__init__(f"p{priority}", priority, outer.log)

        self.Stream = Stream

    def Event(self, enable_timing: bool = False) -> _FakeEvent:
        return _FakeEvent(self.log)

    def current_stream(self, device: object = None) -> _FakeStream:
        return self.current

    def stream(self, s: _FakeStream):  # type: ignore[no-untyped-def]
        import contextlib

        @contextlib.contextmanager
        def ctx():  # type: ignore[no-untyped-def]
            prev, self.current = self.current, s
            try:
                yield
            finally:
                self.current = prev

        return ctx()


class _FakeTorch:
    def __init__(self, cuda: _FakeCuda) -> None:
        self.cuda = cuda

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


def _fake_cuda_copier() -> tuple[BlockCopier, _Log]:
    """A CPU copier whose copies go through the CUDA backend, on mocked streams and events."""
    copier = BlockCopier(_caches(40), 40, 16, staging=True)
    log = _Log()
    copier._backend = CudaBackend(_FakeTorch(_FakeCuda(log)), copier.device)
    for lane, state in copier._lanes.items():
        state.stream = _FakeStream(lane, -5 if lane == "load" else 0, log)
    return copier, log


def test_each_lane_has_its_own_stream_and_demand_loads_the_highest_priority() -> None:
    copier = BlockCopier(_caches(12), 12, 4, staging=True)
    backend = CudaBackend(_FakeTorch(_FakeCuda(_Log())), copier.device)
    block_nbytes = max(p.nbytes for p in copier._parts)
    lanes = {lane: backend.make_lane(lane, copier.chunk_blocks, block_nbytes) for lane in LANES}
    assert lanes["load"].stream.priority == -5
    assert lanes["offload"].stream.priority == lanes["prefetch"].stream.priority == 0
    assert len({id(s.stream) for s in lanes.values()}) == 3
    assert all(s.staging is not None and s.staging.numel() == copier.staging_nbytes for s in lanes.values())


def test_copies_wait_for_compute_on_their_lane() -> None:
    copier, log = _fake_cuda_copier()
    h = copier.copy("h2d", [5, 6], [0, 1], lane="load")
    assert log == [("wait", "load", "compute"), ("record", "load"), ("record", "load")]
    assert h.lane == "load" and h.done() and h.seconds == 0.002
    log.clear()
    copier.copy("d2h", SCATTERED, list(range(10)))  # staged, default lane for D2H
    assert log == [("wait", "offload", "compute"), ("record", "offload"), ("record", "offload")]
    log.clear()
    copier.copy("h2d", [7], [2], lane="prefetch")
    assert log[0] == ("wait", "prefetch", "compute")
    with pytest.raises(ValueError, match="lane"):
        copier.copy("h2d", [7], [2], lane="sideways")  # type: ignore[arg-type]


def test_partially_submitted_copy_still_records_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that fails half-way may have work queued: its handle says when that work is done."""
    copier, log = _fake_cuda_copier()

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(copier, "_run", boom)
    with pytest.raises(CopySubmitError) as err:
        copier.copy("d2h", [1, 2], [0, 1])
    assert "out of memory" in str(err.value)
    assert err.value.handle._event_end is not None and err.value.handle._event_end.stream == "offload"
    assert log[-1] == ("record", "offload")
