"""Copy jobs from plan to report: each job's pins, the step's outbox, completions (commit offloads, publish
prefetches, fail loads), suspect marks, timeouts; every pin released exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from tokencake.serving.kvcore.ports import DeviceBlock as KVCacheBlock
from tokencake.serving.kvcore.records import ABANDONED_POLL_S, Job, Stall, finish_owner, stall_owner
from tokencake.serving.kvcore.wire import CopyJob, CopyReport, JobKind

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

log = logging.getLogger("vllm.tokencake")


class CopyJobs:
    """Copy jobs from plan to report (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core
        #: While given-up copies are out, when the engine next steps so the worker polls them.
        self.poll_abandoned_at: float | None = None
        self.next_job = 1
        self.generation = 0
        self.jobs: dict[int, Job] = {}
        self.outbox: list[CopyJob] = []
        #: Why the workers cannot copy (reported by them), or None.
        self.copies_disabled: str | None = None
        #: Device block id -> the first job id planned after a failed load left bad KV in it (and
        #: took it out of the prefix cache, ``mark_suspect``): a save of it planned before that
        #: is not committed. Dropped once no copy planned before the mark is in flight.
        self.suspect: dict[int, int] = {}
        #: Block hash -> offload job copying it (the host copy exists once that job commits).
        self.filling: dict[bytes, int] = {}
        #: Session id -> its prefetch job being copied.
        self.prefetching: dict[str, int] = {}

    def offload_pending(self, stall: Stall) -> bool:
        """Whether a block of the stall's chain is still being copied to the host."""
        return bool(self.filling) and any(h in self.filling for h in stall.hashes)

    def new_job(
        self,
        kind: JobKind,
        hashes: list[bytes],
        positions: list[int],
        blocks: list[KVCacheBlock],
        slots: list[int],
        *,
        stall_id: str | None = None,
        req_id: str | None = None,
        session_id: str | None = None,
    ) -> Job:
        job = Job(
            self.next_job,
            kind,
            hashes,
            positions,
            blocks,
            list(slots),
            self.core.clock(),
            stall_id,
            req_id,
            session_id,
            self.generation,
        )
        self.next_job += 1
        self.jobs[job.job_id] = job
        if self.core.decisions is not None:
            ids = [b.block_id for b in blocks]
            self.core.note(
                "job", kind=kind, job=job.job_id, hashes=hashes, blocks=ids, slots=job.slots, req=req_id
            )
        return job

    def flush(self) -> list[CopyJob]:
        """Hand over the planned copies (demand loads must reach the workers this very step)."""
        jobs, self.outbox = self.outbox, []
        for job in jobs:
            job.timeout_s = self.core.opts.job_timeout_s
        return jobs

    def on_worker_meta(self, meta: CopyReport | None, invalid_block_ids: Collection[int] = ()) -> None:
        """A step's reports, merged over the ranks (workers): ``meta`` (the copies each rank
        finished) and ``invalid_block_ids`` (the blocks any rank failed to load).

        A job completes — pins released, copies committed or published — once every rank
        reported it: a rank still copying must not have its blocks handed on. A failed load acts
        at the first rank's word (its failed result or its ids): its blocks leave the prefix
        cache and its host copies are dropped in this step, before an offload that this report
        confirms is committed (``_load_failed``).
        """
        if invalid_block_ids:
            self._fail_loads_into(invalid_block_ids)
        if meta is not None:
            self._on_results(meta)
        if self.suspect:
            self._prune_suspect()

    def _fail_loads_into(self, block_ids: Collection[int]) -> None:
        """A rank failed to load into ``block_ids``: fail the loads in flight that target them."""
        failed = set(block_ids)
        for job in list(self.jobs.values()):
            if job.kind == "load" and any(b.block_id in failed for b in job.device_blocks):
                job.ok = False
                try:
                    self._load_failed(job)
                except Exception:  # one bad job must not keep the step's results from completing
                    self.core.stats.inc("errors.complete")
                    log.exception("TokenCake: failing load job %d failed", job.job_id)

    def _on_results(self, meta: CopyReport) -> None:
        if meta.disabled and self.copies_disabled is None:
            self._disable_copies(meta.disabled)
        # Loads first: a failed one marks the blocks computed from it (``mark_suspect``) before
        # an offload of them that the same report confirms is committed.
        results = sorted(
            meta.results.items(), key=lambda item: getattr(self.jobs.get(item[0]), "kind", "") != "load"
        )
        for job_id, res in results:
            job = self.jobs.get(job_id)
            if job is None:
                continue
            try:
                # Act only once every worker reported: a rank whose copy failed must not free
                # blocks another rank is still writing.
                job.reports += res.workers
                job.ok = job.ok and res.ok
                if job.kind == "load" and not job.ok:
                    self._load_failed(job)
                if job.reports < self.core.num_workers:
                    continue
                if job.abandoned:
                    self.core.stats.inc("jobs.late_reports")
                    self._complete(job, ok=False, seconds=res.seconds, error="reported after its timeout")
                else:
                    self._complete(job, ok=job.ok, seconds=res.seconds, error=res.error)
            except Exception:  # one bad completion must not strand the others of this batch
                self.core.stats.inc("errors.complete")
                log.exception("TokenCake: completing job %d failed", job_id)
                self.jobs.pop(job_id, None)
                self.release(job)

    def _complete(self, job: Job, *, ok: bool, seconds: float, error: str | None) -> None:
        self.jobs.pop(job.job_id, None)
        if self.core.decisions is not None:
            stale = job.generation != self.generation
            self.core.note("complete", kind=job.kind, job=job.job_id, ok=ok, stale=stale)
        nbytes = len(job.slots) * self.core.block_bytes
        kind = job.kind
        if ok:
            self.core.stats.inc(f"{kind}.blocks", len(job.slots))
            self.core.stats.inc(f"{kind}.bytes", nbytes)
            self.core.stats.observe(f"{kind}.seconds", seconds)
            if seconds > 0:
                self.core.stats.observe(f"{kind}.bytes_per_s", nbytes / seconds)
            self.core.transfer.observe("d2h" if kind == "offload" else "h2d", nbytes, seconds)
        else:
            self.core.stats.inc(f"{kind}.failed")
            log.warning("TokenCake %s job %d failed: %s", kind, job.job_id, error)
        stale = job.generation != self.generation
        if stale:
            self.core.stats.inc(f"{kind}.dropped_after_reset")
        try:
            if kind == "offload":
                self._complete_offload(job, ok and not stale)
            elif kind == "prefetch":
                self._complete_prefetch(job, ok and not stale)
            else:
                self._complete_load(job, ok)
        finally:
            self.release(job)
        if not ok:  # after the release: bookkeeping for provenance must never strand pins
            self.core.demand.trace_failed_copy(job)
        if kind == "offload":
            self._after_offload(job)
        elif kind == "prefetch" and ok and not stale:
            self.core.uploads.hold_prefetched(job)

    def _complete_offload(self, job: Job, ok: bool) -> None:
        stall = self.core.stalls.active_of(job.session_id)
        for h, block, slot in zip(job.hashes, job.device_blocks, job.slots, strict=True):
            if self.filling.get(h) == job.job_id:
                del self.filling[h]
            # The device block was pinned the whole time, so it must still hold this hash; and a
            # demand load that failed meanwhile may have left its KV computed from bad KV (such a
            # block lost its hash then, ``mark_suspect``, so ``has_hash`` fails too).
            suspect = self.suspect.get(block.block_id, -1) > job.job_id
            if ok and self.core.pool.has_hash(block, h) and not suspect:
                used = self.core.host.commit(h, slot)
                if self.core.decisions is not None:
                    self.core.note("commit", job=job.job_id, hash=h, slot=used)
                if stall is not None and stall.offloaded:
                    self.core.host.pin(used, stall_owner(stall.stall_id))
                elif job.stall_id is None and job.session_id and self.core.policy.uses_events:
                    # An announced stall's save came back before its stall_begin: unpinned, the
                    # copy is the LRU's to reclaim (and its device blocks free to evict) in the
                    # gap, and the stall would find its chain cut. Hold it for the stall.
                    self.core.host.pin(used, finish_owner(job.session_id))
                    self.core.stalls.finish_pins[job.session_id] = (
                        self.core.clock() + self.core.opts.keep_after_end_s
                    )
            else:
                if ok:
                    self.core.stats.inc("offload.suspect_dropped" if suspect else "offload.hash_mismatch")
                self.core.host.invalidate(slot)

    def _after_offload(self, job: Job) -> None:
        """The device pins are gone: an offloaded stall whose chain is now all on host is demoted."""
        stall = self.core.stalls.active_of(job.session_id)
        if stall is not None and stall.offloaded and not self.offload_pending(stall):
            self.core.eviction.demote(stall)

    def _complete_prefetch(self, job: Job, ok: bool) -> None:
        if job.session_id is not None and self.prefetching.get(job.session_id) == job.job_id:
            del self.prefetching[job.session_id]
        stall = self.core.stalls.get(job.stall_id or "")
        published: list[bytes] = []
        if ok and self.core.pool is not None:
            copied = zip(job.hashes, job.positions, job.device_blocks, job.slots, strict=True)
            for h, pos, block, slot in copied:
                if self.core.host.hash_of(slot) != h:
                    # A failed load of the same slot dropped it meanwhile ("may be bad"): the
                    # prefetch copied the same bytes, so they are not published either.
                    self.core.stats.inc("prefetch.source_dropped")
                elif self.core.pool.register(block, h, (pos + 1) * self.core.block_size):
                    published.append(h)
                    self.core.demand.copied[block.block_id] = h
                else:
                    self.core.stats.inc("prefetch.duplicate_blocks")
        if stall is not None:
            stall.prefetched.extend(published)
        if self.core.decisions is not None:
            self.core.note("publish", job=job.job_id, hashes=published)
        if job.stall_id is not None:
            if ok:
                self.core.planner.mark_done(job.stall_id)
            else:
                self.core.planner.cancel(job.stall_id, "prefetch_failed")
        self.core.stats.inc("prefetch.published_blocks", len(published))

    def _complete_load(self, job: Job, ok: bool) -> None:
        if ok:  # vLLM caches these blocks under their hashes: later hits serve the copied KV
            for h, block in zip(job.hashes, job.device_blocks, strict=True):
                self.core.demand.copied[block.block_id] = h
        else:
            self._load_failed(job)

    def _load_failed(self, job: Job) -> None:
        """Act on a failed load once, at the first rank's report of it: its host copies may be
        bad (dropped, so nobody loads them again; vLLM recomputes) and its blocks, and those
        computed from them, leave the prefix cache (``mark_suspect``). Its pins stay until every
        rank reported (``_complete``)."""
        if job.failure_acted:
            return
        job.failure_acted = True
        self.core.demand.settled(job)
        for h in job.hashes:
            self.core.host.drop(h)
        first, ids = job.downstream
        self.mark_suspect(job.req_id or "", first, ids)

    def mark_suspect(self, req_id: str, first: int, block_ids: Sequence[int]) -> None:
        """A demand load of ``req_id`` failed from position ``first``: the failed blocks, and those
        computed from them, hold bad KV under valid hashes. vLLM's ``recompute`` policy (which the
        connector sets) keeps those hashes, trusting the request to recompute the blocks at once;
        a preemption before that, a later chunk, or another request's hit would serve them (and a
        save would commit them to the host). So they leave the prefix cache here (``uncache``: the
        request still recomputes them, they just are not shared afterwards), and a copy of them
        already made is not committed (``_complete_offload``).

        ``block_ids``: the request's blocks from ``first`` on, as allocated at admission. A later
        prefill chunk's blocks (scheduled before the failure was known, with async scheduling)
        are found by the request's own block hashes; a block another request cached under such a
        hash is marked too (conservative: it only stops being shared).
        """
        if self.core.pool is None:
            return
        marked = [bid for bid in block_ids if self.core.pool.is_cached(self.core.pool.block(bid))]
        request = self.core.requests.admitted.get(req_id)
        hashes = list(getattr(request, "block_hashes", None) or ())
        for pos in range(first + len(block_ids), len(hashes)):
            block = self.core.pool.cached(bytes(hashes[pos]))
            if block is not None:
                marked.append(block.block_id)
        for bid in marked:
            self.suspect[bid] = self.next_job
        if self.core.decisions is not None:
            self.core.note("suspect", req=req_id, blocks=marked)
        if marked:
            self.core.pool.uncache(marked)
            self.core.stats.inc("demand_load.uncached_blocks", len(marked))

    def _prune_suspect(self) -> None:
        """Forget marks that no copy in flight was planned before (``suspect``)."""
        oldest = min(self.jobs, default=self.next_job)
        for bid, mark in list(self.suspect.items()):
            if mark <= oldest:
                del self.suspect[bid]

    def release(self, job: Job) -> None:
        """Drop every pin the job holds (device refs and host slot pins), exactly once."""
        if job.released:
            return
        job.released = True
        self.core.host.release(job.owner)
        # Released ready slots join the host LRU; the chain's head last, so it is reclaimed last.
        self.core.host.touch(reversed(job.slots))
        if job.kind == "offload":
            for h in job.hashes:
                if self.filling.get(h) == job.job_id:
                    del self.filling[h]
        elif job.kind == "load":
            self.core.demand.settled(job)
        elif job.kind == "prefetch" and job.session_id is not None:
            if self.prefetching.get(job.session_id) == job.job_id:
                del self.prefetching[job.session_id]
        if job.device_owned and self.core.pool is not None:
            self.core.pool.release(job.device_blocks)
            self.core.holds.counts.forget()  # a held block may be among them (``HoldCounts``)

    def timeout_jobs(self, now: float) -> None:
        """Stop waiting for copies the workers have not confirmed in ``job_timeout_s``.

        Nothing waits for them any more (a request stops waiting for its prefetch; the plan is
        cancelled), but their device blocks and host slots stay pinned until the workers report
        them (the handshake: ``release_after_report``) — a copy still running must not write into
        blocks that were handed to someone else. The late report then fails the job.
        """
        for job in list(self.jobs.values()):
            if job.abandoned or now - job.issued_at < self.core.opts.job_timeout_s:
                continue
            job.abandoned = True
            if self.core.decisions is not None:
                self.core.note("timeout", job=job.job_id)
            self.core.stats.inc("jobs.timed_out")
            age = now - job.issued_at
            log.warning("TokenCake %s job %d unconfirmed after %.0f s", job.kind, job.job_id, age)
            if job.kind == "prefetch":
                if job.session_id is not None and self.prefetching.get(job.session_id) == job.job_id:
                    del self.prefetching[job.session_id]
                if job.stall_id is not None:
                    self.core.planner.cancel(job.stall_id, "timeout")
        # A given-up copy no longer keeps the engine stepping (a hung one would spin it forever),
        # but its pins go only with its report: step every ABANDONED_POLL_S until it comes.
        abandoned = any(j.abandoned for j in self.jobs.values())
        self.poll_abandoned_at = now + ABANDONED_POLL_S if abandoned else None

    def _disable_copies(self, reason: str) -> None:
        """The workers cannot copy (host pool, KV layout): stop planning jobs that would all fail."""
        self.copies_disabled = reason
        self.core.opts.offload = self.core.opts.prefetch = self.core.opts.demand_load = (
            self.core.opts.early_save
        ) = False
        self.core.gate.enabled = False
        self.core.stats.set("worker.copies_disabled", 1)
        log.error("TokenCake: workers cannot copy KV (%s); offload, prefetch and demand load are off", reason)

    def device_copies_in_flight(self) -> int:
        """Copy jobs that still pin device blocks (until the workers report them): while any
        does, vLLM's prefix-cache reset cannot succeed."""
        return sum(1 for job in self.jobs.values() if job.device_owned and not job.released)


__all__ = ["CopyJobs"]
