"""Block copies between the device KV cache and the host pool (torch only, no vLLM).

Why a separate module: the same helpers run inside vLLM's worker process and in
``scripts/gpu_check.py`` on machines that have torch but not vLLM, so what the benchmark
measures is exactly the connector's copy path.

Layout. vLLM hands the worker one tensor per attention layer. Somewhere in its shape is
the block dimension (dim 0 on the CPU backend: ``[num_blocks, heads, block_size, 2*dim]``;
dim 1 for the ``[2, num_blocks, ...]`` CUDA layouts). The host pool keeps, per layer, a
tensor ``[num_host_blocks, *rest]`` with the block dimension first, so a host slot is one
contiguous chunk. Copies are grouped into runs of consecutive block ids and consecutive
slots: one ``copy_`` per run and layer instead of one per block.

Ordering. On CPU a copy is a plain synchronous ``copy_``. On CUDA every copy runs on a
side stream: D2H waits for the compute stream first (the blocks were written by earlier
forwards); H2D records an event that the compute stream waits on before any forward that
may read the blocks (``CopyHandle.order_before_compute``) or that the scheduler polls
(``CopyHandle.done``) before it registers prefetched blocks in the prefix cache.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Direction = Literal["d2h", "h2d"]


def find_block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """Index of the block dimension of a KV tensor with ``num_blocks`` blocks.

    The first dimension whose size equals ``num_blocks`` wins; dim 0 of size 2 (K/V split)
    is skipped when another dimension matches. Raises ``ValueError`` when none matches.
    """
    matches = [i for i, size in enumerate(shape) if size == num_blocks]
    if not matches:
        raise ValueError(f"no dimension of size {num_blocks} (num blocks) in KV shape {tuple(shape)}")
    return matches[0]


def runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group index pairs into maximal runs ``(src_start, dst_start, length)``.

    A run continues while both source and destination ids increase by one, so contiguous
    blocks are copied with one call.
    """
    if len(src) != len(dst):
        raise ValueError(f"copy lists differ in length: {len(src)} != {len(dst)}")
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out:
            s0, d0, n = out[-1]
            if s == s0 + n and d == d0 + n:
                out[-1] = (s0, d0, n + 1)
                continue
        out.append((int(s), int(d), 1))
    return out


@dataclass
class CopyHandle:
    """One submitted copy. On CPU it is complete on return; on CUDA poll ``done()``."""

    direction: Direction
    num_blocks: int
    nbytes: int
    started: float
    _event_start: Any = None
    _event_end: Any = None
    _seconds: float | None = None
    error: str | None = None
    _extra: dict[str, Any] = field(default_factory=dict)

    def done(self) -> bool:
        """True once the data has arrived (always true on CPU)."""
        if self._event_end is None:
            return True
        return bool(self._event_end.query())

    def wait(self) -> None:
        """Block the calling thread until the copy finished."""
        if self._event_end is not None:
            self._event_end.synchronize()

    def order_before_compute(self) -> None:
        """Make the current (compute) stream wait for this copy without blocking the host."""
        if self._event_end is not None:
            import torch

            torch.cuda.current_stream().wait_event(self._event_end)

    @property
    def seconds(self) -> float:
        """Copy duration; on CUDA measured between stream events (call after ``done()``)."""
        if self._seconds is None and self._event_end is not None and self.done():
            self._seconds = self._event_start.elapsed_time(self._event_end) / 1000.0
        return self._seconds if self._seconds is not None else 0.0


class BlockCopier:
    """Host pool storage plus the D2H / H2D block copy helpers.

    ``device_caches``: layer name -> device KV tensor (as given to ``register_kv_caches``).
    The host tensors are allocated once here (pinned when the device is CUDA) and never
    grow: the pool is the pre-allocated buffer the TokenCake paper calls for.
    """

    def __init__(
        self,
        device_caches: Mapping[str, torch.Tensor],
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        pin: bool | None = None,
    ) -> None:
        import torch

        if num_host_blocks <= 0:
            raise ValueError(f"num_host_blocks must be > 0, got {num_host_blocks}")
        if not device_caches:
            raise ValueError("no KV cache tensors to copy")
        self.num_host_blocks = num_host_blocks
        self._torch = torch
        self._names = list(device_caches)
        first = next(iter(device_caches.values()))
        self.device = first.device
        self.is_cuda = first.device.type == "cuda"
        if pin is None:
            pin = self.is_cuda
        # Several layer names can share one tensor (e.g. tied / KV-sharing layers): copy it once.
        seen: dict[int, str] = {}
        self._dev_views: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for name in self._names:
            t = device_caches[name]
            key = t.data_ptr()
            if key in seen:
                continue
            seen[key] = name
            bd = find_block_dim(t.shape, num_device_blocks)
            view = t.movedim(bd, 0) if bd else t
            host = torch.empty(
                (num_host_blocks, *view.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin
            )
            self._dev_views.append(view)
            self._host.append(host)
        self.block_bytes = sum(h[0].numel() * h.element_size() for h in self._host)
        self._stream = torch.cuda.Stream(device=self.device) if self.is_cuda else None

    @property
    def host_tensors(self) -> list[torch.Tensor]:
        """The per-layer host tensors (tests read them to check bytes)."""
        return self._host

    def _check(self, device_blocks: Sequence[int], host_slots: Sequence[int]) -> None:
        n_dev = self._dev_views[0].shape[0]
        for b in device_blocks:
            if not 0 <= b < n_dev:
                raise IndexError(f"device block {b} out of range [0, {n_dev})")
        for s in host_slots:
            if not 0 <= s < self.num_host_blocks:
                raise IndexError(f"host slot {s} out of range [0, {self.num_host_blocks})")

    def copy(
        self, direction: Direction, device_blocks: Sequence[int], host_slots: Sequence[int]
    ) -> CopyHandle:
        """Submit one copy of whole blocks; raises on bad ids (nothing copied then)."""
        self._check(device_blocks, host_slots)
        torch = self._torch
        n = len(device_blocks)
        handle = CopyHandle(direction, n, n * self.block_bytes, time.perf_counter())
        if direction == "d2h":
            plan = runs(device_blocks, host_slots)
        elif direction == "h2d":
            plan = runs(host_slots, device_blocks)
        else:
            raise ValueError(f"unknown direction {direction!r}")
        if self._stream is None:
            self._run(direction, plan, non_blocking=False)
            handle._seconds = time.perf_counter() - handle.started
            return handle
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            # Earlier forwards wrote (D2H) or may still read the destination (H2D): order after them.
            self._stream.wait_stream(compute)
            start.record(self._stream)
            self._run(direction, plan, non_blocking=True)
            end.record(self._stream)
        handle._event_start, handle._event_end = start, end
        return handle

    def _run(self, direction: Direction, plan: list[tuple[int, int, int]], *, non_blocking: bool) -> None:
        for dev, host in zip(self._dev_views, self._host, strict=True):
            for a, b, n in plan:
                if direction == "d2h":
                    host[b : b + n].copy_(dev[a : a + n], non_blocking=non_blocking)
                else:
                    dev[b : b + n].copy_(host[a : a + n], non_blocking=non_blocking)


__all__ = ["BlockCopier", "CopyHandle", "Direction", "find_block_dim", "runs"]
