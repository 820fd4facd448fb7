"""CUDA copy backend: every copy runs on the side stream of its lane.

``load`` (demand loads, highest priority) never queues behind a large ``offload`` or
``prefetch``, each of which has its own low-priority stream. A copy waits for the compute
stream first (the blocks were written by earlier forwards, or may still be read by them); H2D
records an event that the compute stream waits on before any forward that may read the blocks
(``CopyHandle.order_before_compute``) or that the worker polls (``CopyHandle.done``) before it
reports the job.
"""

from __future__ import annotations

from collections.abc import Callable

from tokencake.serving.vllm._copy_backend import (
    CopyBackend,
    CopyHandle,
    CopyLane,
    CopySubmitError,
    Lane,
    staging_buffers,
)


class CudaBackend(CopyBackend):
    """Stream-ordered copies, timed between CUDA events; poll the handle's ``done()``."""

    non_blocking = True

    def make_lane(self, lane: Lane, staging_blocks: int, block_nbytes: int) -> CopyLane:
        torch = self._torch
        low, high = torch.cuda.Stream.priority_range()
        stream = torch.cuda.Stream(device=self.device, priority=high if lane == "load" else low)
        out = CopyLane(stream)
        if staging_blocks > 0:
            # Allocated once, on the lane's stream: the caching allocator ties the blocks to it, and
            # every user of the buffers runs on that stream (stream-ordered reuse, no record_stream).
            with torch.cuda.stream(stream):
                out.staging, out.index = staging_buffers(torch, self.device, staging_blocks, block_nbytes)
        return out

    def run(self, handle: CopyHandle, lane: CopyLane, submit: Callable[[], None]) -> CopyHandle:
        torch = self._torch
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(lane.stream):
            # Earlier forwards wrote (D2H) or may still read the destination (H2D): order after them.
            lane.stream.wait_stream(compute)
            start.record(lane.stream)
            try:
                submit()
            except Exception as exc:
                # Part of the copy may be queued: its end event tells when it can no longer write.
                end.record(lane.stream)
                handle._event_start, handle._event_end = start, end
                raise CopySubmitError(f"{type(exc).__name__}: {exc}", handle) from exc
            end.record(lane.stream)
        handle._event_start, handle._event_end = start, end
        return handle


__all__ = ["CudaBackend"]
