"""The host-pool copy helpers (torch only): byte-exact round trips, layouts, run grouping."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tokencake.serving.vllm import _copy  # noqa: E402
from tokencake.serving.vllm._copy import (  # noqa: E402
    LANES,
    BlockCopier,
    CopySubmitError,
    GeometryError,
    HostMemoryError,
    StagedChunk,
    block_geometry,
    check_host_memory,
    copy_parts,
    find_block_dim,
    gather_into_host,
    host_runs,
    runs,
    staged_chunks,
    use_staging,
)


def _caches(layout: str, num_blocks: int = 12, layers: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    shape = (num_blocks, 2, 16, 8) if layout == "blocks_first" else (2, num_blocks, 16, 8)
    return {f"layer.{i}": torch.randn(shape, generator=gen).to(torch.bfloat16) for i in range(layers)}


def test_runs_group_consecutive_pairs() -> None:
    assert runs([3, 4, 5, 9], [0, 1, 2, 3]) == [(3, 0, 3), (9, 3, 1)]
    assert runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]
    assert runs([], []) == []
    with pytest.raises(ValueError):
        runs([1], [])


def test_find_block_dim() -> None:
    assert find_block_dim((40, 3, 128, 128), 40) == 0
    assert find_block_dim((2, 40, 16, 8, 64), 40) == 1
    with pytest.raises(ValueError, match="no dimension"):
        find_block_dim((2, 16), 40)


@pytest.mark.parametrize("layout", ["blocks_first", "kv_first"])
def test_round_trip_is_byte_exact(layout: str) -> None:
    caches = _caches(layout)
    bd = 0 if layout == "blocks_first" else 1
    copier = BlockCopier(caches, num_device_blocks=12, num_host_blocks=6)
    original = {k: v.clone() for k, v in caches.items()}
    h = copier.copy("d2h", [2, 3, 4, 9], [5, 0, 1, 2])
    assert h.done() and h.nbytes == 4 * copier.block_bytes and h.seconds >= 0
    # Clobber the device blocks, then bring them back into other device blocks.
    for t in caches.values():
        t.select(bd, 2).zero_()
    copier.copy("h2d", [6, 7, 8, 10], [5, 0, 1, 2])
    for name, t in caches.items():
        src, dst = original[name].movedim(bd, 0), t.movedim(bd, 0)
        for a, b in zip([2, 3, 4, 9], [6, 7, 8, 10], strict=True):
            assert torch.equal(dst[b].view(torch.int16), src[a].view(torch.int16))
        # Untouched blocks stay untouched.
        assert torch.equal(dst[11], src[11])


def test_block_bytes_and_shared_layers() -> None:
    caches = _caches("blocks_first", layers=2)
    caches["alias"] = caches["layer.0"]  # a layer sharing another's tensor is copied once
    copier = BlockCopier(caches, num_device_blocks=12, num_host_blocks=2)
    assert len(copier.host_tensors) == 2
    assert copier.block_bytes == 2 * (2 * 16 * 8 * 2)


def test_bad_ids_raise_before_copying() -> None:
    copier = BlockCopier(_caches("blocks_first"), num_device_blocks=12, num_host_blocks=2)
    with pytest.raises(IndexError):
        copier.copy("d2h", [1], [2])
    with pytest.raises(IndexError):
        copier.copy("h2d", [0], [12])
    with pytest.raises(ValueError):
        copier.copy("sideways", [0], [0])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BlockCopier(_caches("blocks_first"), num_device_blocks=12, num_host_blocks=0)


# ------------------------------------------------------------------ scattered ids (staging plan)


def test_host_runs_are_offset_slot_length() -> None:
    assert host_runs([4, 5, 6, 0, 1, 9]) == [(0, 4, 3), (3, 0, 2), (5, 9, 1)]
    assert host_runs([]) == []
    assert host_runs([3, 3]) == [(0, 3, 1), (1, 3, 1)]


def test_use_staging_only_when_it_saves_copies() -> None:
    assert not use_staging(1, 1)  # contiguous
    assert not use_staging(2, 1)  # a couple of runs: plain copies
    assert use_staging(3, 1)
    assert use_staging(64, 1)  # scattered device ids, consecutive host slots
    assert use_staging(64, 32)
    assert not use_staging(64, 33)
    assert not use_staging(64, 64)  # both sides scattered: staging saves nothing


def test_staged_chunks_split_and_offsets() -> None:
    slots = [10, 11, 12, 13, 14, 0, 1]
    assert staged_chunks(slots, 16) == [StagedChunk(0, 7, ((0, 10, 5), (5, 0, 2)))]
    assert staged_chunks(slots, 3) == [
        StagedChunk(0, 3, ((0, 10, 3),)),
        StagedChunk(3, 3, ((0, 13, 2), (2, 0, 1))),
        StagedChunk(6, 1, ((0, 1, 1),)),
    ]
    assert staged_chunks([], 4) == []
    with pytest.raises(ValueError):
        staged_chunks(slots, 0)
    # Every pair is covered exactly once, in order.
    covered = [
        (c.start + off + i, slot + i)
        for c in staged_chunks(slots, 3)
        for off, slot, n in c.host_runs
        for i in range(n)
    ]
    assert covered == list(enumerate(slots))


def test_gather_into_host_flags_scattered_host_runs() -> None:
    # host run [0..3] fed by scattered blocks; host run [7..8] fed by one device run
    assert gather_into_host([9, 2, 40, 5, 20, 21], [0, 1, 2, 3, 7, 8]) == [True, False]
    assert gather_into_host([1, 2, 3], [0, 1, 2]) == [False]
    assert gather_into_host([1, 2, 7, 8], [0, 1, 2, 3]) == [False]  # runs of two: per-run copies
    assert gather_into_host([5], [3]) == [False]


def _scattered_round_trip(
    layout: str, staging: bool, dev_ids: list[int], slots: list[int], **kw: int
) -> BlockCopier:
    num_dev = 40
    caches = _caches(layout, num_blocks=num_dev, layers=3)
    bd = 0 if layout == "blocks_first" else 1
    copier = BlockCopier(caches, num_device_blocks=num_dev, num_host_blocks=32, staging=staging, **kw)
    original = {k: v.clone() for k, v in caches.items()}
    h = copier.copy("d2h", dev_ids, slots)
    assert h.done() and h.nbytes == len(dev_ids) * copier.block_bytes
    for host, (name, src) in zip(copier.host_tensors, original.items(), strict=True):
        src0 = src.movedim(bd, 0)
        for d, s in zip(dev_ids, slots, strict=True):
            assert torch.equal(host[s].view(torch.int16), src0[d].view(torch.int16)), (name, d, s)
    # Scatter back into other device blocks (a permutation of the free ones).
    free = [b for b in range(num_dev) if b not in dev_ids]
    targets = free[::-1][: len(dev_ids)]
    for t in caches.values():
        t.zero_()
    copier.copy("h2d", targets, slots)
    for name, t in caches.items():
        src0, dst0 = original[name].movedim(bd, 0), t.movedim(bd, 0)
        for a, b in zip(dev_ids, targets, strict=True):
            assert torch.equal(dst0[b].view(torch.int16), src0[a].view(torch.int16))
        untouched = [b for b in range(num_dev) if b not in targets]
        assert torch.count_nonzero(dst0[untouched].view(torch.int16)) == 0
    return copier


SCATTERED = [17, 3, 29, 8, 11, 12, 35, 0, 22, 5]


@pytest.mark.parametrize("layout", ["blocks_first", "kv_first"])
@pytest.mark.parametrize("staging", [False, True])
@pytest.mark.parametrize(
    "slots",
    [list(range(4, 14)), [20, 21, 22, 23, 0, 1, 2, 30, 31, 9], [7, 2, 30, 11, 19, 4, 25, 0, 16, 28]],
    ids=["consecutive", "few_runs", "scattered"],
)
def test_scattered_round_trip_is_byte_exact(layout: str, staging: bool, slots: list[int]) -> None:
    _scattered_round_trip(layout, staging, SCATTERED, slots)


def test_staged_copies_in_chunks_with_a_fixed_buffer_per_lane() -> None:
    layer_bytes = 2 * 16 * 8 * 2
    copier = _scattered_round_trip(
        "blocks_first", True, SCATTERED, list(range(10)), staging_bytes=3 * layer_bytes
    )
    assert copier.chunk_blocks == 3
    assert copier.staging_nbytes == 3 * layer_bytes  # bounded: 10 blocks went in 4 chunks
    bufs = {lane: st.staging for lane, st in copier._lanes.items()}
    assert len({id(b) for b in bufs.values()}) == len(LANES)  # one buffer per lane: no sharing
    copier.copy("d2h", SCATTERED, list(range(10)))
    copier.copy("h2d", SCATTERED, list(range(10)), lane="prefetch")
    assert all(copier._lanes[lane].staging is buf for lane, buf in bufs.items())  # allocated once


def test_staging_is_chosen_by_the_plan() -> None:
    copier = BlockCopier(_caches("blocks_first", num_blocks=40), 40, 32, staging=True)
    assert copier.copy("d2h", SCATTERED, list(range(10)))._extra["staged"]
    assert not copier.copy("d2h", list(range(10)), list(range(10)))._extra["staged"]
    assert not copier.copy("d2h", SCATTERED, [7, 2, 30, 11, 19, 4, 25, 0, 16, 28])._extra["staged"]
    assert not BlockCopier(_caches("blocks_first"), 12, 4).staging  # CPU default: plain copies


# ------------------------------------------------------------------ geometry and layouts


def test_block_geometry_finds_blocks_and_kernel_blocks() -> None:
    assert block_geometry((40, 3, 128, 128), 40) == (0, 1)
    assert block_geometry((2, 40, 16, 8, 64), 40) == (1, 1)  # K/V-first
    assert block_geometry((160, 3, 32, 128), 40) == (0, 4)  # 4 kernel blocks per scheduler block
    # dim 0 wins over a later dim that happens to equal num_blocks
    assert block_geometry((80, 40, 16, 8), 40) == (0, 2)
    with pytest.raises(GeometryError, match="no dimension"):
        block_geometry((30, 3, 16, 8), 40)
    with pytest.raises(GeometryError):
        block_geometry((40, 3), 0)


def test_kernel_blocks_are_copied_per_scheduler_block() -> None:
    """Kernel block size 8 under scheduler blocks of 16: block b is kernel rows 2b and 2b+1."""
    gen = torch.Generator().manual_seed(1)
    caches = {f"l{i}": torch.randn((24, 2, 8, 4), generator=gen) for i in range(2)}
    copier = BlockCopier(caches, num_device_blocks=12, num_host_blocks=4)
    assert copier.block_bytes == 2 * (2 * 2 * 8 * 4 * 4)
    before = {k: v.clone() for k, v in caches.items()}
    copier.copy("d2h", [5, 6], [0, 1])
    copier.copy("h2d", [0, 11], [0, 1])
    for name, t in caches.items():
        assert torch.equal(t[0:2], before[name][10:12]) and torch.equal(t[22:24], before[name][12:14])
        assert torch.equal(t[2:22], before[name][2:22])


def test_kv_first_layout_copies_each_half_as_contiguous_runs() -> None:
    """``[2, B, ...]``: a block is a K half and a V half; each half of a run is one byte range."""
    caches = _caches("kv_first", num_blocks=40)
    view = caches["layer.0"].movedim(1, 0)
    perm, outer = copy_parts(view)
    assert (perm[:2], outer) == ([0, 1], 1)  # the K/V dim is split off
    copier = _scattered_round_trip("kv_first", True, SCATTERED, list(range(10)))
    assert len(copier._parts) == 2 * 3 and all(p.dense for p in copier._parts)
    assert copier.noncontiguous_copies == 0


def test_host_pool_is_allocated_exactly() -> None:
    """No power-of-two rounding: 5 slots of 3 layers take 3 x 5 blocks (plus alignment)."""
    layer_bytes = 2 * 16 * 8 * 2
    copier = BlockCopier(_caches("blocks_first"), num_device_blocks=12, num_host_blocks=5)
    per_layer = -(-5 * layer_bytes // _copy.HOST_ALIGN) * _copy.HOST_ALIGN
    assert copier.host_nbytes == 3 * per_layer
    assert copier.host_nbytes < 2 ** (copier.host_nbytes - 1).bit_length()


# ------------------------------------------------------------------ host memory checks


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MAP_POPULATE"), reason="MAP_POPULATE is Linux-only")
def test_host_pool_pages_are_backed_when_it_is_allocated() -> None:
    """Not at the first offload into them: on a lazily backed VM a first write to a page is a fault
    the hypervisor serves (offloads ran ~50 x slower into a fresh pool)."""
    nbytes = 48 << 20
    before = _resident_bytes()
    buf = _copy.populated_host_buffer(nbytes)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes and buf.is_contiguous()
    assert _resident_bytes() - before >= 0.9 * nbytes  # resident now, before anything is written
    assert int(buf[:4096].sum()) == 0  # anonymous memory: zeros
    buf[nbytes - 1] = 7
    assert int(buf[nbytes - 1]) == 7
    # The copier's pool is such a buffer (a 40-slot pool of 3 layers of 4 KiB blocks).
    before = _resident_bytes()
    caches = {f"layer.{i}": torch.zeros(4, 2, 256, 4) for i in range(3)}  # 8 KiB per block per layer
    copier = BlockCopier(caches, num_device_blocks=4, num_host_blocks=400)
    assert _resident_bytes() - before >= 0.9 * copier.host_nbytes
    assert copier.copy("d2h", [1, 2], [0, 399]).done()


def test_host_pool_falls_back_to_lazy_pages_where_it_cannot_map_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(_copy.mmap, "MAP_POPULATE", raising=False)
    buf = _copy.populated_host_buffer(1 << 20)
    assert buf.numel() == 1 << 20 and buf.dtype == torch.uint8
    assert _copy.populated_host_buffer(0).numel() == 0


def test_host_memory_check_refuses_a_pool_larger_than_free_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    check_host_memory(8 << 30, None)  # unknown: allowed
    check_host_memory(8 << 30, 10 << 30)
    with pytest.raises(HostMemoryError) as err:
        check_host_memory(40 << 30, 31 << 30)
    msg = str(err.value)
    assert "\n" not in msg and "--host-pool-gib" in msg and "40.0 GiB" in msg and "27.9" in msg
    monkeypatch.setattr(_copy, "available_ram_bytes", lambda: 1000)
    with pytest.raises(HostMemoryError):
        BlockCopier(_caches("blocks_first"), num_device_blocks=12, num_host_blocks=5)
    BlockCopier(_caches("blocks_first"), 12, 5, check_ram=False)  # tools may skip the check


def test_available_ram_is_known_on_linux() -> None:
    avail = _copy.available_ram_bytes()
    assert avail is None or avail > 0


def test_failed_pinning_falls_back_to_pageable_memory(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_copy, "pin_host_memory", lambda t: "cudaHostRegister returned error 2")
    with caplog.at_level("WARNING", logger="vllm.tokencake.copy"):
        copier = BlockCopier(_caches("blocks_first"), 12, 4, pin=True)
    assert not copier.pinned
    (rec,) = caplog.records
    assert "could not pin" in rec.getMessage() and "RLIMIT_MEMLOCK" in rec.getMessage()
    assert copier.copy("d2h", [1, 2], [0, 1]).done()  # still copies


def test_pinned_pool_is_unpinned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    unpinned: list[int] = []
    monkeypatch.setattr(_copy, "pin_host_memory", lambda t: None)
    monkeypatch.setattr(_copy, "unpin_host_memory", lambda t: unpinned.append(t.data_ptr()))
    copier = BlockCopier(_caches("blocks_first"), 12, 4, pin=True)
    assert copier.pinned
    copier.close()
    copier.close()
    assert unpinned == [copier._flat.data_ptr()]


def test_pin_without_cuda_reports_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert _copy.pin_host_memory(torch.empty(16, dtype=torch.uint8))


# ------------------------------------------------------------------ CUDA lanes (mocked streams)


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
    copier = BlockCopier(_caches("blocks_first", num_blocks=40), 40, 16, staging=True)
    log = _Log()
    copier._torch = _FakeTorch(_FakeCuda(log))  # type: ignore[assignment]
    for lane, state in copier._lanes.items():
        state.stream = _FakeStream(lane, -5 if lane == "load" else 0, log)
    return copier, log


def test_each_lane_has_its_own_stream_and_demand_loads_the_highest_priority() -> None:
    copier = BlockCopier(_caches("blocks_first"), 12, 4, staging=True)
    copier._torch = _FakeTorch(_FakeCuda(_Log()))  # type: ignore[assignment]
    copier.is_cuda = True
    lanes = {lane: copier._make_lane(lane) for lane in LANES}
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
