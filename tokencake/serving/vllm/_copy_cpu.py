"""CPU copy backend: each copy is a plain synchronous ``copy_`` on the calling thread.

The host tensors are directly addressable, so a copy is complete, and ordered after every
earlier forward, when :meth:`CpuBackend.run` returns; its time is the wall-clock time it took.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tokencake.serving.vllm._copy_backend import CopyBackend, CopyHandle, CopyLane, Lane, staging_buffers


class CpuBackend(CopyBackend):
    """Synchronous copies: nothing is left running when :meth:`run` returns."""

    non_blocking = False

    def make_lane(self, lane: Lane, staging_blocks: int, block_nbytes: int) -> CopyLane:
        out = CopyLane()
        if staging_blocks > 0:
            out.staging, out.index = staging_buffers(self._torch, self.device, staging_blocks, block_nbytes)
        return out

    def run(self, handle: CopyHandle, lane: CopyLane, submit: Callable[[], None]) -> CopyHandle:
        submit()
        handle._seconds = time.perf_counter() - handle.started
        return handle


__all__ = ["CpuBackend"]
