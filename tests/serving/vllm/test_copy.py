"""The block copier on CPU tensors: byte-exact round trips, shared layers, bad ids, the staging plan."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tokencake.serving.vllm._copy import BlockCopier  # noqa: E402
from tokencake.serving.vllm._copy_backend import LANES  # noqa: E402
from tokencake.serving.vllm._kv_layout import copy_parts  # noqa: E402


def _caches(layout: str, num_blocks: int = 12, layers: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    shape = (num_blocks, 2, 16, 8) if layout == "blocks_first" else (2, num_blocks, 16, 8)
    return {f"layer.{i}": torch.randn(shape, generator=gen).to(torch.bfloat16) for i in range(layers)}


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
