"""Worker-side half of the connector: runs the copies the scheduler planned.

Runs in vLLM's worker process (one per GPU; one process on the CPU backend). It owns the host
pool's tensors (allocated in ``register_kv_caches``, once) and executes each step's
:class:`~tokencake.serving.vllm.metadata.CopyJob` list:

* ``load`` jobs (demand loads) feed a forward of this very step; vLLM calls ``start_load_kv``
  before the forward when the step has such loads, and on CUDA the compute stream waits on
  the copy's event. ``prefetch`` jobs write blocks the scheduler allocated privately (no hash,
  nobody reads them), so they start there too.
* ``offload`` jobs start in ``wait_for_save``, after the step's forward. vLLM gives a block its
  prefix hash when it allocates it for a step, *before* the forward writes it; an offload the
  scheduler planned in that same step (a stalled session whose chain hash was just re-allocated
  for another request with the same prefix) would copy stale bytes if it ran in a
  ``start_load_kv`` that precedes the forward. After the forward (stream-ordered on CUDA) every
  block hashed up to this step holds the KV the forward computed.

Completions go back to the scheduler through ``build_connector_worker_meta`` (vLLM carries it
in ``KVConnectorOutput.kv_connector_worker_meta``); a failed demand load is also reported by
block id in ``get_block_ids_with_load_errors`` so vLLM recomputes those tokens.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tokencake.serving.vllm._copy import BlockCopier, CopyHandle
from tokencake.serving.vllm.metadata import CopyJob, JobResult, TokenCakeMetadata, TokenCakeWorkerMeta

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.tokencake.worker")


class WorkerSide:
    """Executes copy jobs; never raises into vLLM's forward path (errors become failed jobs)."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int) -> None:
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.copier: BlockCopier | None = None
        self._inflight: dict[int, tuple[CopyJob, CopyHandle]] = {}
        self._finished: dict[int, JobResult] = {}
        self._load_errors: set[int] = set()
        #: Offloads received this step, started in :meth:`start_saves` (after the forward).
        self._saves: list[CopyJob] = []
        self.error: str | None = None
        # Job ids already started (bounded memory; ids only grow, so old ones never come back).
        self._seen: set[int] = set()
        self._seen_order: deque[int] = deque()

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Allocate the host pool next to the device KV (same dtype and per-block shape)."""
        try:
            self.copier = BlockCopier(kv_caches, self.num_device_blocks, self.num_host_blocks)
            log.info(
                "TokenCake host pool: %d blocks x %d bytes (%.1f MiB), pinned=%s",
                self.num_host_blocks,
                self.copier.block_bytes,
                self.num_host_blocks * self.copier.block_bytes / 2**20,
                self.copier.is_cuda,
            )
        except Exception as exc:  # no host pool: every job fails, vLLM recomputes
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("TokenCake host pool allocation failed; copies disabled")

    def start_jobs(self, meta: TokenCakeMetadata) -> None:
        """Submit this step's loads and prefetches in order; keep its offloads for after the forward."""
        for job in meta.jobs:
            if job.job_id and job.job_id in self._seen:
                continue  # the same metadata bound twice (defensive): never copy twice
            self._remember(job.job_id)
            if job.kind == "offload" and not job.invalid:
                self._saves.append(job)
                continue
            self._submit(job)
        self._poll()

    def start_saves(self) -> None:
        """Submit the offloads held back by :meth:`start_jobs` (vLLM's ``wait_for_save``)."""
        saves, self._saves = self._saves, []
        for job in saves:
            self._submit(job)
        self._poll()

    def _submit(self, job: CopyJob) -> None:
        if job.invalid:
            self._load_errors.update(job.device_blocks)
            return
        try:
            if self.copier is None:
                raise RuntimeError(self.error or "host pool not allocated")
            handle = self.copier.copy(job.direction, job.device_blocks, job.host_slots)
            if job.kind == "load":
                handle.order_before_compute()
        except Exception as exc:
            log.warning("TokenCake copy job %d (%s) failed: %s", job.job_id, job.kind, exc)
            self._finished[job.job_id] = JobResult(False, 0.0, 0, f"{type(exc).__name__}: {exc}")
            if job.kind == "load":
                self._load_errors.update(job.device_blocks)
            return
        self._inflight[job.job_id] = (job, handle)

    def _remember(self, job_id: int, limit: int = 4096) -> None:
        self._seen.add(job_id)
        self._seen_order.append(job_id)
        while len(self._seen_order) > limit:
            self._seen.discard(self._seen_order.popleft())

    def _poll(self) -> None:
        for job_id, (job, handle) in list(self._inflight.items()):
            try:
                done = handle.done()
            except Exception as exc:  # a failed copy is a failed job, never an exception into vLLM
                del self._inflight[job_id]
                self._finished[job_id] = JobResult(False, 0.0, 0, f"{type(exc).__name__}: {exc}")
                if job.kind == "load":
                    self._load_errors.update(job.device_blocks)
                continue
            if done:
                del self._inflight[job_id]
                self._finished[job_id] = JobResult(True, handle.seconds, handle.nbytes)

    def take_results(self) -> TokenCakeWorkerMeta | None:
        """Finished jobs since the last call (None when nothing finished)."""
        self._poll()
        if not self._finished:
            return None
        out = TokenCakeWorkerMeta(self._finished)
        self._finished = {}
        return out

    def take_load_errors(self) -> set[int]:
        """Device block ids whose demand load failed since the last call."""
        out, self._load_errors = self._load_errors, set()
        return out

    @property
    def busy(self) -> bool:
        return bool(self._inflight or self._saves)

    def shutdown(self) -> None:
        for _job, handle in self._inflight.values():
            try:
                handle.wait()
            except Exception:
                pass
        self._inflight.clear()


__all__ = ["WorkerSide"]
