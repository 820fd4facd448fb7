"""The host-pool copy helpers (torch only): byte-exact round trips, layouts, run grouping."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tokencake.serving.vllm._copy import BlockCopier, find_block_dim, runs  # noqa: E402


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
