"""The copier against the KV views vLLM 0.32 really builds, in every layout it can resolve.

vLLM hands the connector ``[B, H, N, C]`` views whose strides follow the resolved layout
(FlashAttention's default ``LBNHC`` stores a block as ``[N, H, C]``; block-outer layouts
interleave the layers' pages) and, when the kernel block size is smaller than the scheduler's,
kernel-block rows. A copy must be byte-exact in each and, under the CUDA plan (staging on),
never copy a non-contiguous run: on a GPU that would allocate a temporary per copy.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from tokencake.serving.vllm._copy import BlockCopier  # noqa: E402
from tokencake.serving.vllm._kv_layout import block_view  # noqa: E402

NUM_BLOCKS, LAYERS = 12, 3


def vllm_views(
    layout: KVCacheLayout, kernel_block_size: int | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The backing buffer and per-layer views, built the way ``allocate_kv_cache`` does."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    interleaved = spec.page_size_bytes * LAYERS if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, NUM_BLOCKS, LAYERS, layout, fixed_strides=(None, interleaved, None, None, None)
    )
    size = spec.page_size_bytes * LAYERS * NUM_BLOCKS
    raw = torch.randint(-128, 127, (size,), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    names = [f"layer.{i}" for i in range(LAYERS)]
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride)
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor, kernel_block_size=kernel_block_size)
    return raw, views


CASES = [(layout, None) for layout in KVCacheLayout] + [
    (KVCacheLayout.LBNHC, 8),  # kernel blocks of 8 under scheduler blocks of 16
    (KVCacheLayout.LBHNC, 4),
]


@pytest.mark.parametrize("staging", [False, True], ids=["cpu_plan", "cuda_plan"])
@pytest.mark.parametrize(("layout", "kernel"), CASES, ids=[f"{lay.name}-{k}" for lay, k in CASES])
def test_round_trip_in_every_vllm_layout(layout: KVCacheLayout, kernel: int | None, staging: bool) -> None:
    raw, views = vllm_views(layout, kernel)
    caches = {f"layer.{i}": v for i, v in enumerate(views)}
    copier = BlockCopier(caches, NUM_BLOCKS, num_host_blocks=6, staging=staging)
    before = [block_view(v, NUM_BLOCKS).clone() for v in views]
    src, slots, dst = [3, 4, 5, 9, 1], [0, 1, 2, 5, 3], [0, 2, 7, 8, 11]
    copier.copy("d2h", src, slots)
    raw.zero_()
    copier.copy("h2d", dst, slots)
    rest = [b for b in range(NUM_BLOCKS) if b not in dst]
    for v, old in zip(views, before, strict=True):
        now = block_view(v, NUM_BLOCKS).view(torch.int16)
        for a, b in zip(src, dst, strict=True):
            assert torch.equal(now[b], old[a].view(torch.int16)), (layout.name, a, b)
        assert torch.count_nonzero(now[rest]) == 0  # nothing else written
    assert copier.block_bytes * NUM_BLOCKS == raw.numel()
    if staging:
        assert copier.noncontiguous_copies == 0, "a GPU temporary per copy on CUDA"


def test_flash_attention_default_layout_copies_runs_directly() -> None:
    """LBNHC (vLLM's default on CUDA) is dense per layer: contiguous runs need no staging."""
    _raw, views = vllm_views(KVCacheLayout.LBNHC, None)
    assert not views[0].is_contiguous()  # the logical [B, H, N, C] view is permuted
    copier = BlockCopier({f"l{i}": v for i, v in enumerate(views)}, NUM_BLOCKS, 4, staging=True)
    assert copier.dense
    h = copier.copy("d2h", [2, 3, 4], [0, 1, 2])
    assert not h._extra["staged"] and copier.noncontiguous_copies == 0
