"""The host-pool copy helpers (torch only): byte-exact round trips, layouts, run grouping."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tokencake.serving.vllm._copy import (  # noqa: E402
    BlockCopier,
    StagedChunk,
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


def test_staged_copies_in_chunks_with_a_bounded_reused_buffer() -> None:
    layer_bytes = 2 * 16 * 8 * 2
    copier = _scattered_round_trip(
        "blocks_first", True, SCATTERED, list(range(10)), staging_bytes=3 * layer_bytes
    )
    assert copier.chunk_blocks == 3
    assert copier.staging_nbytes == 3 * layer_bytes  # bounded: 10 blocks went in 4 chunks
    buf = copier._staging
    copier.copy("d2h", SCATTERED, list(range(10)))
    assert copier._staging is buf  # steady state: no new allocation


def test_staging_is_chosen_by_the_plan() -> None:
    copier = BlockCopier(_caches("blocks_first", num_blocks=40), 40, 32, staging=True)
    assert copier.copy("d2h", SCATTERED, list(range(10)))._extra["staged"]
    assert not copier.copy("d2h", list(range(10)), list(range(10)))._extra["staged"]
    assert not copier.copy("d2h", SCATTERED, [7, 2, 30, 11, 19, 4, 25, 0, 16, 28])._extra["staged"]
    assert not BlockCopier(_caches("blocks_first"), 12, 4).staging  # CPU default: plain copies
