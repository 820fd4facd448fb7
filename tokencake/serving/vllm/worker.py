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

Every accepted job is reported exactly once, and only when its copy can no longer touch the
device blocks or host slots: complete, failed before anything was submitted, or (a CUDA copy
that failed half-way) once its queued part has run. That is the worker half of the job timeout
handshake: a scheduler that sets ``TokenCakeMetadata.release_after_report`` keeps a timed-out
job's blocks until this report arrives (TokenCake's own scheduler always does). For a scheduler
that releases them at the timeout instead, :meth:`WorkerSide.before_forward` fences every copy
older than half its ``timeout_s``: the next forward (and, through it, every later copy) waits
for it. That fence is best effort: it is checked only on steps that bind copy jobs, so it covers
such a scheduler only while copies keep being planned.

Fault injection for tests: ``TOKENCAKE_FAULTS="copy_fail=0.2,copy_stall_s=0.5,seed=1"`` makes
copies fail (nothing written, job failed → recompute) or stall (held back, then written late →
timeout path); see :func:`parse_faults`. A bad value logs one warning and injects nothing.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokencake.serving.vllm._copy import BlockCopier
from tokencake.serving.vllm._copy_backend import CopySubmitError
from tokencake.serving.vllm._host_memory import HostMemoryError
from tokencake.serving.vllm._kv_layout import GeometryError
from tokencake.serving.vllm.metadata import (
    DEFAULT_JOB_TIMEOUT_S,
    CopyJob,
    JobResult,
    TokenCakeMetadata,
    TokenCakeWorkerMeta,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.tokencake.worker")

FAULTS_ENV = "TOKENCAKE_FAULTS"
_KINDS = frozenset(("offload", "prefetch", "load"))
_FAULT_KEYS = ("copy_fail", "copy_stall", "copy_stall_s", "kinds", "seed")


# ------------------------------------------------------------------ fault injection


@dataclass(frozen=True)
class Faults:
    """Copy faults to inject (``TOKENCAKE_FAULTS``), to exercise the failure paths end to end."""

    #: Probability that a copy fails before writing anything.
    copy_fail: float = 0.0
    #: Probability that a copy is held back ``copy_stall_s`` seconds (then written, late).
    copy_stall: float = 0.0
    copy_stall_s: float = 0.0
    #: Job kinds the faults apply to.
    kinds: frozenset[str] = _KINDS
    #: Seed of the draws (None: a different sequence each run).
    seed: int | None = None

    @property
    def active(self) -> bool:
        return self.copy_fail > 0 or (self.copy_stall > 0 and self.copy_stall_s > 0)


def parse_faults(text: str) -> Faults | None:
    """Parse ``key=value`` pairs separated by commas; raises ``ValueError`` on any bad item.

    Keys: ``copy_fail`` (probability), ``copy_stall`` (probability, default 1 when
    ``copy_stall_s`` is given), ``copy_stall_s`` (seconds, at most 3600), ``kinds``
    (``offload+prefetch+load``, default all) and ``seed`` (int). Empty text: None.
    """
    values: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"{item.strip()!r} is not key=value")
        if key not in _FAULT_KEYS:
            raise ValueError(f"unknown key {key!r} (known: {', '.join(_FAULT_KEYS)})")
        if key in values:
            raise ValueError(f"{key} given twice")
        values[key] = value
    if not values:
        return None

    def number(key: str, hi: float) -> float:
        v = float(values[key])
        if not (math.isfinite(v) and 0.0 <= v <= hi):
            raise ValueError(f"{key}={values[key]} must be in [0, {hi:g}]")
        return v

    stall_s = number("copy_stall_s", 3600.0) if "copy_stall_s" in values else 0.0
    default_stall = 1.0 if stall_s > 0 else 0.0
    kinds = _KINDS
    if "kinds" in values:
        kinds = frozenset(k.strip() for k in values["kinds"].split("+"))
        if not kinds or not kinds <= _KINDS:
            raise ValueError(f"kinds={values['kinds']} must be a '+'-list of {'/'.join(sorted(_KINDS))}")
    return Faults(
        copy_fail=number("copy_fail", 1.0) if "copy_fail" in values else 0.0,
        copy_stall=number("copy_stall", 1.0) if "copy_stall" in values else default_stall,
        copy_stall_s=stall_s,
        kinds=kinds,
        seed=int(values["seed"]) if "seed" in values else None,
    )


def faults_from_env(environ: Mapping[str, str] | None = None) -> Faults | None:
    """The faults ``TOKENCAKE_FAULTS`` asks for; a bad value logs one warning and injects none."""
    text = (os.environ if environ is None else environ).get(FAULTS_ENV, "")
    if not text.strip():
        return None
    try:
        faults = parse_faults(text)
    except Exception as exc:  # a typo in a test knob must never take the worker down
        log.warning("TokenCake: ignoring %s=%r (%s); no faults injected", FAULTS_ENV, text, exc)
        return None
    if faults is not None and faults.active:
        log.warning("TokenCake: fault injection ON (%s=%s)", FAULTS_ENV, text)
    return faults


class InjectedFault(RuntimeError):
    """A copy failure asked for by ``TOKENCAKE_FAULTS``."""


# ------------------------------------------------------------------ handles


class _Handle(Protocol):
    """What the worker needs of a submitted copy (``CopyHandle`` or a stalled one)."""

    nbytes: int

    def done(self) -> bool: ...

    def wait(self) -> None: ...

    def order_before_compute(self) -> None: ...

    @property
    def seconds(self) -> float: ...


class _StalledCopy:
    """A copy held back ``due - now`` seconds (fault injection): nothing is written before it is
    submitted, when it is due, as if a real copy were still running that long."""

    def __init__(
        self,
        submit: Callable[[], _Handle],
        due: float,
        nbytes: int,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> None:
        self._submit, self._due, self.nbytes = submit, due, nbytes
        self._clock, self._sleep = clock, sleep
        self._handle: _Handle | None = None
        #: The submit failed after part of the copy was queued: the job fails once that part ran.
        self.error: str | None = None

    def _start(self) -> _Handle:
        if self._handle is None:
            try:
                self._handle = self._submit()
            except CopySubmitError as exc:  # wait for the queued part, as an unstalled copy does
                self._handle, self.error = exc.handle, _describe(exc)
        return self._handle

    def done(self) -> bool:
        if self._handle is None and self._clock() < self._due:
            return False
        return self._start().done()

    def wait(self) -> None:
        if self._handle is None:
            left = self._due - self._clock()
            if left > 0:
                self._sleep(left)
        self._start().wait()

    def order_before_compute(self) -> None:
        self.wait()  # a held-back copy cannot be stream-ordered before it exists
        self._start().order_before_compute()

    @property
    def seconds(self) -> float:
        return self._handle.seconds if self._handle is not None else 0.0


@dataclass
class _InFlight:
    job: CopyJob
    handle: _Handle
    received: float
    #: The copy failed after part of it was queued: reported failed once that part has run.
    error: str | None = None
    fenced: bool = False


def _timeout(job: CopyJob) -> float:
    t = job.timeout_s
    return float(t) if isinstance(t, (int, float)) and t > 0 else DEFAULT_JOB_TIMEOUT_S


def _block_ids(blocks: Iterable[Any]) -> set[int]:
    """The integer ids of a (possibly malformed) block list."""
    try:
        return {b for b in blocks if isinstance(b, int)}
    except Exception:
        return set()


def _describe(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # an exception whose str() fails is still a failed job
        return type(exc).__name__


# ------------------------------------------------------------------ the worker side


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
        self._inflight: dict[int, _InFlight] = {}
        self._finished: dict[int, JobResult] = {}
        self._load_errors: set[int] = set()
        #: Offloads received this step, started in :meth:`start_saves` (after the forward).
        self._saves: list[CopyJob] = []
        #: The scheduler keeps timed-out jobs' blocks until our report (no fence needed).
        self._handshake = False
        # Job ids already started (bounded memory; ids only grow, so old ones never come back).
        self._seen: set[int] = set()
        self._seen_order: deque[int] = deque()
        #: Event counts for logs and tests (``errors.<where>``, ``faults.*``, ``fenced``, ...).
        self.counters: dict[str, int] = {}

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
            self.disabled = _describe(exc)
            log.error("TokenCake: copies disabled, %s", exc)
        except Exception as exc:  # no host pool: every job fails, vLLM recomputes
            self.disabled = _describe(exc)
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
                self._fence_stale()
            self._poll()
        except Exception:
            self._count_error("before_forward")

    def start_jobs(self, meta: TokenCakeMetadata) -> None:
        """Submit this step's loads and prefetches in order; keep its offloads for after the forward."""
        self.before_forward(meta)  # nothing new may overtake a stale copy
        try:
            jobs = list(meta.jobs)
        except Exception:
            self._count_error("start_jobs")
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
            self._poll()
            tell = self.disabled is not None and not self._disabled_reported
            if not self._finished and not tell:
                return None
            out = TokenCakeWorkerMeta(self._finished, self.disabled)
            self._finished = {}
            self._disabled_reported = self._disabled_reported or self.disabled is not None
            return out
        except Exception:
            self._count_error("take_results")
            return None

    def take_load_errors(self) -> set[int]:
        """Device block ids whose demand load failed since the last call."""
        out, self._load_errors = self._load_errors, set()
        return out

    @property
    def busy(self) -> bool:
        return bool(self._inflight or self._saves)

    def shutdown(self) -> None:
        for rec in list(self._inflight.values()):
            try:
                rec.handle.wait()
            except Exception:
                pass
        self._inflight.clear()
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
            self._fail(job, exc)

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
            self._load_errors.update(_block_ids(job.device_blocks))
            return
        if self.copier is None:
            raise RuntimeError(self.disabled or "host pool not allocated")
        if job.kind not in _KINDS:
            raise ValueError(f"unknown job kind {job.kind!r}")
        copier, direction = self.copier, job.direction
        blocks, slots = list(job.device_blocks), list(job.host_slots)

        def submit() -> _Handle:
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
                handle: _Handle = _StalledCopy(
                    submit, due, len(blocks) * copier.block_bytes, self._clock, self._sleep
                )
            else:
                handle = submit()
        except CopySubmitError as exc:  # part of the copy is queued: report when it has run
            handle = exc.handle
            rec = _InFlight(job, handle, now, error=_describe(exc))
        else:
            rec = _InFlight(job, handle, now)
        self._inflight[job.job_id] = rec
        if job.kind == "load":
            if rec.error is not None:
                self._load_errors.update(_block_ids(blocks))
            self._order_load(rec)

    def _order_load(self, rec: _InFlight) -> None:
        """A demand load feeds this step's forward: make the forward wait for it. The job stays in
        flight either way and is reported once, by :meth:`_poll`, when its copy has run."""
        try:
            rec.handle.order_before_compute()
        except Exception as exc:
            rec.error = rec.error or _describe(exc)
            try:
                rec.handle.wait()  # no stream order: block until the copy is done
            except Exception as again:
                rec.error = rec.error or _describe(again)
        late = getattr(rec.handle, "error", None)  # a held-back copy whose submit failed half way
        if late is not None:
            rec.error = rec.error or late
        if rec.error is not None:
            self._load_errors.update(_block_ids(rec.job.device_blocks))

    def _draw_fault(self, job: CopyJob) -> str | None:
        f = self.faults
        if f is None or not f.active or job.kind not in f.kinds:
            return None
        if f.copy_fail > 0 and self._rng.random() < f.copy_fail:
            self._count("faults.copy_fail")
            return "fail"
        if f.copy_stall_s > 0 and f.copy_stall > 0 and self._rng.random() < f.copy_stall:
            self._count("faults.copy_stall")
            return "stall"
        return None

    def _fail(self, job: CopyJob, exc: BaseException) -> None:
        """Report a job failed (by id, and by block for a demand load); never raises."""
        self._count("jobs.failed")
        try:
            error = _describe(exc)
            job_id = getattr(job, "job_id", None)
            kind = getattr(job, "kind", None)
            if isinstance(exc, InjectedFault):
                log.debug("TokenCake copy job %s (%s): %s", job_id, kind, error)
            else:
                log.warning("TokenCake copy job %s (%s) failed: %s", job_id, kind, error)
            if isinstance(job_id, int):
                self._finished[job_id] = JobResult(False, 0.0, 0, error)
            if kind == "load":
                self._load_errors.update(_block_ids(getattr(job, "device_blocks", ())))
        except Exception:  # a job too broken to even describe: nothing to report it under
            self._count("errors.fail")

    def _remember(self, job_id: int, limit: int = 4096) -> None:
        self._seen.add(job_id)
        self._seen_order.append(job_id)
        while len(self._seen_order) > limit:
            self._seen.discard(self._seen_order.popleft())

    def _poll_guarded(self) -> None:
        try:
            self._poll()
        except Exception:
            self._count_error("poll")

    def _poll(self) -> None:
        """Report every job whose copy has completed; a job whose query raises is failed alone."""
        now = self._clock()
        for job_id, rec in list(self._inflight.items()):
            try:
                if not rec.handle.done():
                    continue
                seconds, nbytes = float(rec.handle.seconds), int(rec.handle.nbytes)
            except Exception as exc:  # a failed copy is a failed job, never an exception into vLLM
                self._inflight.pop(job_id, None)
                self._fail(rec.job, exc)
                continue
            self._inflight.pop(job_id, None)
            late = now - rec.received > _timeout(rec.job)
            if late:
                self._count("jobs.late")
            error = rec.error or getattr(rec.handle, "error", None)
            if error is not None:
                self._count("jobs.failed")
                self._finished[job_id] = JobResult(False, seconds, 0, error, late=late)
            else:
                self._finished[job_id] = JobResult(True, seconds, nbytes, late=late)

    def _fence_stale(self) -> None:
        now = self._clock()
        for rec in list(self._inflight.values()):
            if rec.fenced or now - rec.received < 0.5 * _timeout(rec.job):
                continue
            rec.fenced = True
            self._count("fenced")
            log.warning(
                "TokenCake copy job %d (%s) still running after %.1f s; the next forward waits for it",
                rec.job.job_id,
                rec.job.kind,
                now - rec.received,
            )
            try:
                rec.handle.order_before_compute()
            except Exception:
                try:
                    rec.handle.wait()
                except Exception:
                    self._count_error("fence")

    # ---------------------------------------------------------------- counters
    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def _count_error(self, where: str) -> None:
        self._count(f"errors.{where}")
        log.exception("TokenCake worker: %s failed (ignored)", where)


__all__ = ["FAULTS_ENV", "Faults", "InjectedFault", "WorkerSide", "faults_from_env", "parse_faults"]
