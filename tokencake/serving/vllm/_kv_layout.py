"""How a device KV tensor maps onto scheduler blocks (torch only, no vLLM).

vLLM 0.32 hands the worker one ``[B, H, N, C]`` view per attention layer (K and V packed in
``C``) whose strides follow the resolved KV layout: ``LBNHC`` (FlashAttention's default)
stores a block as ``[N, H, C]``, block-outer layouts (``BL…``) interleave the layers' pages,
and older layouts put K/V first (``[2, B, …]``). When the kernel block size is smaller than
the scheduler's, dim 0 counts kernel blocks, ``ratio`` per scheduler block (vLLM's own
``group_kernel_blocks`` view). A layer is viewed block-first in *memory* order and a leading
K/V dim is split off, so every part of a block is one contiguous byte range
(:func:`copy_parts`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: A leading dim with a stride above the block stride is split into parts only when it is this
#: small (K/V). Larger ones (heads in an ``LHBNC`` layout) stay whole and go through staging.
MAX_SPLIT = 2


class GeometryError(ValueError):
    """The device KV tensors have no block layout this copier can map to scheduler blocks."""


def block_geometry(shape: Sequence[int], num_blocks: int) -> tuple[int, int]:
    """``(block_dim, ratio)`` of a KV tensor for ``num_blocks`` scheduler blocks.

    ``block_dim`` is 0 for vLLM 0.32's ``[B, H, N, C]`` views and 1 for a K/V-first
    ``[2, B, ...]`` tensor. ``ratio`` is the number of kernel blocks per scheduler block (the
    size of ``block_dim`` is ``ratio * num_blocks``; 1 when the block sizes agree). Raises
    :class:`GeometryError` when neither dim fits.
    """
    if num_blocks <= 0:
        raise GeometryError(f"num_blocks must be > 0, got {num_blocks}")
    dims = [0] + ([1] if len(shape) > 1 and shape[0] == 2 else [])
    for dim in dims:
        if shape and shape[dim] == num_blocks:
            return dim, 1
    for dim in dims:
        if shape and shape[dim] > num_blocks and shape[dim] % num_blocks == 0:
            return dim, shape[dim] // num_blocks
    raise GeometryError(
        f"no dimension of size {num_blocks} (num blocks) or a multiple of it (kernel blocks) "
        f"in KV shape {tuple(shape)}"
    )


def find_block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """Index of the block dimension of a KV tensor (see :func:`block_geometry`)."""
    return block_geometry(shape, num_blocks)[0]


def block_view(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``t`` viewed ``[num_blocks, ...]``: block dim first, kernel blocks grouped per block."""
    dim, ratio = block_geometry(t.shape, num_blocks)
    view = t.movedim(dim, 0) if dim else t
    if ratio > 1:  # kernel block j of block b is row b * ratio + j (uniformly strided: a view)
        view = view.unflatten(0, (num_blocks, ratio))
    return view


def memory_order(view: torch.Tensor) -> list[int]:
    """Dim permutation of a block-first view: dim 0, then the others by decreasing stride."""
    rest = sorted(
        range(1, view.dim()),
        key=lambda d: view.stride(d) if view.shape[d] > 1 else -1,
        reverse=True,
    )
    return [0, *rest]


def copy_parts(view: torch.Tensor) -> tuple[list[int], int]:
    """``(perm, num_outer)``: how to split a block-first view into dense parts.

    ``view.permute(perm)`` puts the dims in memory order. Its first ``num_outer`` dims after
    the block dim have strides above the block stride (a K/V dim in front of the blocks): a
    block cannot be one byte range across them, so each of their indices is its own part (a K
    half and a V half). Only splits into at most :data:`MAX_SPLIT` parts are made.
    """
    perm = memory_order(view)
    pv = view.permute(perm)
    outer = 0
    while outer + 1 < pv.dim() and pv.shape[outer + 1] > 1 and pv.stride(outer + 1) > pv.stride(0):
        outer += 1
    if math.prod(pv.shape[1 : 1 + outer]) > MAX_SPLIT:
        outer = 0
    return perm, outer


def is_dense(part: torch.Tensor) -> bool:
    """Whether every run of consecutive blocks of ``part`` is one contiguous byte range."""
    if part.shape[0] == 0 or not part[0].is_contiguous():
        return False
    return part.shape[0] == 1 or part.stride(0) == part[0].numel()


def layer_views(device_caches: Mapping[str, torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """One block-first view per distinct tensor (tied / KV-sharing layers are copied once)."""
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    views = []
    for t in device_caches.values():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key in seen:
            continue
        seen.add(key)
        views.append(block_view(t, num_blocks))
    return views


__all__ = [
    "MAX_SPLIT",
    "GeometryError",
    "block_geometry",
    "block_view",
    "copy_parts",
    "find_block_dim",
    "is_dense",
    "layer_views",
    "memory_order",
]
