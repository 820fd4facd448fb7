"""Worker-side half of the connector: runs the copies the scheduler planned.

Runs in vLLM's worker process (one per GPU; one process on the CPU backend). It owns the host
pool's memory (allocated in ``register_kv_caches``, once) and executes each step's
:class:`~tokencake.serving.vllm.metadata.CopyJob` list:

* ``load`` jobs (demand loads) feed a forward of this very step; vLLM calls ``start_load_kv``
  before the forward when the step has such loads, and on CUDA the compute stream waits on
  the copy's event. ``prefetch`` jobs write blocks the scheduler allocated privately (no hash,
  nobody reads them), so they start there too. Each kind has its own copy lane (stream), so a
  demand load never queues behind a large offload or prefetch.
* ``offload`` jobs start in ``wait_for_save``, after the step's forward. vLLM gives a block its
  prefix hash when it allocates it for a step, *before* the forward writes it; an offload the
  scheduler planned in that same step (a stalled session whose chain hash was just re-allocated
  for another request with the same prefix) would copy stale bytes if it ran in a
  ``start_load_kv`` that precedes the forward. After the forward (stream-ordered on CUDA) every
  block hashed up to this step holds the KV the forward computed.

Completions go back to the scheduler through ``build_connector_worker_meta`` (vLLM carries it
in ``KVConnectorOutput.kv_connector_worker_meta``); a failed demand load is also reported by
block id in ``get_block_ids_with_load_errors`` so vLLM recomputes those tokens.

Nothing here may raise into vLLM: an exception in a worker hook ends EngineCore and every
request in flight. Each job is handled under its own guard, so a bad job (bad ids, a failed
copy, an event query that raises) is reported failed (the scheduler recomputes) and the other
jobs of the step go on; each public method has a guard of its own on top.

Each accepted job is reported exactly once, when its copy can no longer touch its blocks
(:mod:`~tokencake.serving.vllm._inflight`). For a scheduler without
``release_after_report``, :meth:`WorkerSide.before_forward` fences copies older than half
their ``timeout_s``. That fence is best effort: it is checked only on steps that bind copy
jobs, so it covers such a scheduler only while copies keep being planned.

Fault injection for tests: ``TOKENCAKE_FAULTS`` (:mod:`~tokencake.serving.vllm.faults`).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from tokencake.serving.vllm._copy import BlockCopier
from tokencake.serving.vllm._copy_backend import CopySubmitError
from tokencake.serving.vllm._host_memory import HostMemoryError
from tokencake.serving.vllm._inflight import (
    JOB_KINDS,
    Counters,
    InFlight,
    InFlightJobs,
    SubmittedCopy,
    block_ids,
    describe,
)
from tokencake.serving.vllm._kv_layout import GeometryError
from tokencake.serving.vllm.faults import FAULTS_ENV, Faults, InjectedFault, StalledCopy, faults_from_env
from tokencake.serving.vllm.metadata import CopyJob, TokenCakeMetadata, TokenCakeWorkerMeta

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.tokencake.worker")


class WorkerSide:
    """Executes copy jobs; never raises into vLLM's forward path (errors become failed jobs)."""

    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.copier: BlockCopier | None = None
        #: Why copies cannot run at all (reported to the scheduler, which stops planning them).
        self.disabled: str | None = None
        self._disabled_reported = False
        self.faults = faults if faults is not None else faults_from_env()
        self._rng = random.Random(self.faults.seed if self.faults is not None else None)
        self._clock, self._sleep = clock, sleep
        #: Event counts for logs and tests (``errors.<where>``, ``faults.*``, ``fenced``, ...).
        self.counters = Counters()
        self._jobs = InFlightJobs(clock, self.counters)
        #: Offloads received this step, started in :meth:`start_saves` (after the forward).
        self._saves: list[CopyJob] = []
        #: The scheduler keeps timed-out jobs' blocks until our report (no fence needed).
        self._handshake = False
        # Job ids already started (bounded memory; ids only grow, so old ones never come back).
        self._seen: set[int] = set()
        self._seen_order: deque[int] = deque()

    @property
    def error(self) -> str | None:
        """Alias of :attr:`disabled` (why no copy can run)."""
        return self.disabled

    # ---------------------------------------------------------------- setup
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Allocate the host pool next to the device KV (same dtype and per-block shape)."""
        try:
            if self.num_host_blocks <= 0:
                self.disabled = "host pool size is 0"
                log.info("TokenCake: host pool size is 0; copies off")
                return
            self.copier = BlockCopier(kv_caches, self.num_device_blocks, self.num_host_blocks)
            log.info(
                "TokenCake host pool: %d blocks x %d bytes (%.1f MiB), pinned=%s, dense layout=%s",
                self.num_host_blocks,
                self.copier.block_bytes,
                self.copier.host_nbytes / 2**20,
                self.copier.pinned,
                self.copier.dense,
            )
        except (GeometryError, HostMemoryError) as exc:  # expected misfits: one clear line
            self.disabled = describe(exc)
            log.error("TokenCake: copies disabled, %s", exc)
        except Exception as exc:  # no host pool: every job fails, vLLM recomputes
            self.disabled = describe(exc)
            log.exception("TokenCake host pool allocation failed; copies disabled")

    # ---------------------------------------------------------------- per step
    def before_forward(self, meta: TokenCakeMetadata | None = None) -> None:
        """On a step that binds copy jobs, before they start: fence stale copies and collect
        finished ones (finished ones are also collected every step by ``take_results``).

        The fence is for a scheduler that releases a timed-out job's blocks (no
        ``release_after_report``): a copy still running at half its timeout is ordered before
        the next forward, so a block reused after the scheduler gave up is never written by it.
        """
        try:
            if meta is not None:
                self._handshake = bool(getattr(meta, "release_after_report", False))
            if not self._handshake:
                self._jobs.fence_stale()
            self._jobs.poll()
        except Exception:
            self.counters.count_error("before_forward")

    def start_jobs(self, meta: TokenCakeMetadata) -> None:
        """Submit this step's loads and prefetches in order; keep its offloads for after the forward."""
        self.before_forward(meta)  # nothing new may overtake a stale copy
        try:
            jobs = list(meta.jobs)
        except Exception:
            self.counters.count_error("start_jobs")
            return
        for job in jobs:
            self._guarded(job, self._accept)
        self._poll_guarded()

    def start_saves(self) -> None:
        """Submit the offloads held back by :meth:`start_jobs` (vLLM's ``wait_for_save``)."""
        saves, self._saves = self._saves, []
        for job in saves:
            self._guarded(job, self._submit)
        self._poll_guarded()

    def take_results(self) -> TokenCakeWorkerMeta | None:
        """Finished jobs since the last call (None when nothing to say).

        While copies are disabled the reason goes with the first report and every later one
        that carries results, so the scheduler learns it even if it never planned a job.
        """
        try:
            self._jobs.poll()
            tell = self.disabled is not None and not self._disabled_reported
            if not self._jobs.finished and not tell:
                return None
            out = TokenCakeWorkerMeta(self._jobs.finished, self.disabled)
            self._jobs.finished = {}
            self._disabled_reported = self._disabled_reported or self.disabled is not None
            return out
        except Exception:
            self.counters.count_error("take_results")
            return None

    def take_load_errors(self) -> set[int]:
        """Device block ids whose demand load failed since the last call."""
        return self._jobs.take_load_errors()

    @property
    def busy(self) -> bool:
        return bool(self._jobs.inflight or self._saves)

    def shutdown(self) -> None:
        self._jobs.wait_all()
        if self.copier is not None:
            try:
                self.copier.close()
            except Exception:
                pass

    # ---------------------------------------------------------------- jobs
    def _guarded(self, job: CopyJob, step: Callable[[CopyJob], None]) -> None:
        """Run one job's step; any exception fails that job only."""
        try:
            step(job)
        except Exception as exc:
            self._jobs.fail(job, exc, quiet=isinstance(exc, InjectedFault))

    def _accept(self, job: CopyJob) -> None:
        if job.job_id and job.job_id in self._seen:
            return  # the same metadata bound twice (defensive): never copy twice
        self._remember(job.job_id)
        if job.kind == "offload" and not job.invalid:
            self._saves.append(job)
            return
        self._submit(job)

    def _submit(self, job: CopyJob) -> None:
        if job.invalid:
            self._jobs.load_errors.update(block_ids(job.device_blocks))
            return
        if self.copier is None:
            raise RuntimeError(self.disabled or "host pool not allocated")
        if job.kind not in JOB_KINDS:
            raise ValueError(f"unknown job kind {job.kind!r}")
        copier, direction = self.copier, job.direction
        blocks, slots = list(job.device_blocks), list(job.host_slots)

        def submit() -> SubmittedCopy:
            return copier.copy(direction, blocks, slots, lane=job.kind)

        fault = self._draw_fault(job)
        now = self._clock()
        if fault == "fail":
            raise InjectedFault(f"injected copy failure ({FAULTS_ENV})")
        try:
            if fault == "stall":
                assert self.faults is not None
                copier.check(blocks, slots)  # bad ids fail now, as a real copy would
                due = now + self.faults.copy_stall_s
                handle: SubmittedCopy = StalledCopy(
                    submit, due, len(blocks) * copier.block_bytes, self._clock, self._sleep
                )
            else:
                handle = submit()
        except CopySubmitError as exc:  # part of the copy is queued: report when it has run
            handle = exc.handle
            rec = InFlight(job, handle, now, error=describe(exc))
        else:
            rec = InFlight(job, handle, now)
        self._jobs.add(rec)
        if job.kind == "load":
            if rec.error is not None:
                self._jobs.load_errors.update(block_ids(blocks))
            self._order_load(rec)

    def _order_load(self, rec: InFlight) -> None:
        """A demand load feeds this step's forward: make the forward wait for it. The job stays in
        flight either way and is reported once, by :meth:`InFlightJobs.poll`, when its copy has run."""
        try:
            rec.handle.order_before_compute()
        except Exception as exc:
            rec.error = rec.error or describe(exc)
            try:
                rec.handle.wait()  # no stream order: block until the copy is done
            except Exception as again:
                rec.error = rec.error or describe(again)
        late = getattr(rec.handle, "error", None)  # a held-back copy whose submit failed half way
        if late is not None:
            rec.error = rec.error or late
        if rec.error is not None:
            self._jobs.load_errors.update(block_ids(rec.job.device_blocks))

    def _draw_fault(self, job: CopyJob) -> str | None:
        f = self.faults
        if f is None or not f.active or job.kind not in f.kinds:
            return None
        if f.copy_fail > 0 and self._rng.random() < f.copy_fail:
            self.counters.count("faults.copy_fail")
            return "fail"
        if f.copy_stall_s > 0 and f.copy_stall > 0 and self._rng.random() < f.copy_stall:
            self.counters.count("faults.copy_stall")
            return "stall"
        return None

    def _remember(self, job_id: int, limit: int = 4096) -> None:
        self._seen.add(job_id)
        self._seen_order.append(job_id)
        while len(self._seen_order) > limit:
            self._seen.discard(self._seen_order.popleft())

    def _poll_guarded(self) -> None:
        try:
            self._jobs.poll()
        except Exception:
            self.counters.count_error("poll")


__all__ = ["WorkerSide"]
