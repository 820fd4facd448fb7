"""Demand load and provenance: host-pool hits past the device prefix, the load planned for an admission,
and where each admitted prompt's KV came from.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokencake.serving.kvcore.ports import RequestView
from tokencake.serving.kvcore.records import Job, ReqInfo
from tokencake.serving.kvcore.wire import CopyJob
from tokencake.serving.sessions import ByteLRU

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

log = logging.getLogger("vllm.tokencake")


class DemandLoad:
    """Demand load and provenance (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core
        #: req_id -> (first block, hashes, slots) from the last get_num_new_matched_tokens.
        self.pending_load: dict[str, tuple[int, list[bytes], list[int]]] = {}
        #: req_id -> device prefix-cache hit (tokens) of a session request, for accounting.
        self.local_hit: dict[str, int] = {}
        #: request id -> where its prompt KV came from at admission (until it finishes).
        self.provenance: dict[str, dict[str, int]] = {}
        #: session id -> tokens of its copies (offload, prefetch) that failed since its last
        #: admission; reported with the next request's provenance (a faulty copy's trace).
        self.failed_copies: ByteLRU[str, int] = ByteLRU(max_items=4096, max_bytes=1 << 20)
        #: device block id -> the hash whose KV a host copy (prefetch or load) wrote into it. A hit
        #: on such a block serves copied KV, whichever session's copy put it there (provenance).
        self.copied: dict[int, bytes] = {}
        #: Device block id -> the demand load in flight that fills it or computes it from loaded KV
        #: (the load's request blocks from its first loaded one on): vLLM caches these at
        #: allocation, before the load is confirmed (``waits_for_load``). Set when the load is
        #: planned; cleared when its failure is acted on or its job completes.
        self.loading: dict[int, int] = {}
        self.usa_req: str | None = None
        self.usa_first = 0

    def waits_for_prefetch(self, info: ReqInfo, *, count: bool) -> bool:
        """Whether the request waits for its session's prefetch copy: at most ``prefetch_wait_s``
        after the copy was issued. ``count``: count it (once per request) and the give-up."""
        job = self.core.copies.jobs.get(self.core.copies.prefetching.get(info.session_id, 0))
        if job is None:
            return False
        if count and not info.waited_for_prefetch:
            info.waited_for_prefetch = True
            self.core.stats.inc("demand_load.waited_for_prefetch")
        if self.core.clock() - job.issued_at < self.core.opts.prefetch_wait_s:
            return True
        if count:
            # A copy this slow is not worth waiting for: load on demand (the prefetch's blocks
            # are its own; whichever lands second is simply not published).
            self.core.stats.inc("demand_load.gave_up_waiting")
        return False

    def waits_for_load(self, request: RequestView, num_computed_tokens: int) -> bool:
        """Whether the request's device prefix hit (its first ``num_computed_tokens``) includes
        blocks of a demand load in flight (``loading``): it waits ("not yet"), since the load may
        still fail.

        A demand load is synchronous for vLLM, which caches its blocks when it allocates them.
        Under async scheduling the next step is scheduled before this step's output (the load's
        result) is back; a request admitted then on the same prefix would keep tokens computed
        from KV the load may not have written, while vLLM rewinds only the loading request. A
        load reports within a step or two: the request waits at most ``prefetch_wait_s`` after
        the load was issued (``admission.held_back.load_in_flight``, each pass). Past it, the
        late load's blocks leave the prefix cache (the loading request keeps them; they are
        only not shared) and the request waits one more pass, after which vLLM's lookup stops
        before them (``admission.past_bound.load_in_flight``).
        """
        if not self.loading or self.core.pool is None:
            return False
        late: set[int] = set()
        waits = False
        for h in list(request.block_hashes)[: num_computed_tokens // self.core.block_size]:
            block = self.core.pool.cached(bytes(h))
            if block is None:
                break
            job = self.core.copies.jobs.get(self.loading.get(block.block_id, 0))
            if job is None:
                continue
            waits = True
            if self.core.clock() - job.issued_at >= self.core.opts.prefetch_wait_s:
                late.add(job.job_id)
        if not waits:
            return False
        if late:
            self.core.stats.inc("admission.past_bound.load_in_flight")
            for job_id in late:
                self.settled(self.core.copies.jobs[job_id], uncache=True)
        else:
            self.core.stats.inc("admission.held_back.load_in_flight")
        return True

    def settled(self, job: Job, *, uncache: bool = False) -> None:
        """The load's outcome is known (or no longer waited for): its blocks leave ``loading``;
        ``uncache``: and the prefix cache."""
        ids = [bid for bid in job.downstream[1] if self.loading.get(bid) == job.job_id]
        for bid in ids:
            del self.loading[bid]
        if uncache and ids and self.core.pool is not None:
            self.core.pool.uncache(ids)

    def local_hits(self, request: RequestView) -> list[bytes]:
        """The request's device prefix hit as vLLM's lookup will find it: its block hashes cached
        on device, unbroken from block 0, leaving a token to compute; none for a request that
        reads no prefix cache (``prompt_logprobs``)."""
        if self.core.pool is None or getattr(request, "skip_reading_prefix_cache", False):
            return []
        hits: list[bytes] = []
        for h in list(request.block_hashes)[: (int(request.num_tokens) - 1) // self.core.block_size]:
            h = bytes(h)
            if self.core.pool.cached(h) is None:
                break
            hits.append(h)
        return hits

    def host_hits(self, request: RequestView, first: int) -> tuple[list[bytes], list[int]]:
        """The hashes and host slots of the request's blocks from block ``first`` on that the host
        pool has, unbroken, leaving a token to compute (vLLM needs one to sample from)."""
        if not (self.core.opts.demand_load and self.core.policy.demand_load):
            return [], []
        if self.core.pool is None or self.core.host.num_blocks == 0:
            return [], []
        limit = (int(request.num_tokens) - 1) // self.core.block_size
        used: list[bytes] = []
        found: list[int] = []
        for h in list(request.block_hashes)[first:limit]:
            slot = self.core.host.lookup(bytes(h))
            if slot is None:
                break
            used.append(bytes(h))
            found.append(slot)
        return used, found

    def record_provenance(
        self, request: RequestView, info: ReqInfo | None, local_tokens: int, host_tokens: int
    ) -> None:
        """Where the prompt's KV came from at admission: device prefix hit (of it, blocks a prefetch
        of this session put there), host-pool load, computed. Returned with the response
        (``kv_transfer_params.tokencake_kv``) so a mismatch can be traced to its source.

        ``copied_tokens`` counts device hits on blocks whose KV a host copy wrote (any session's
        prefetch or load: a shared prefix); a block recomputed later under the same hash into the
        same block id would still count (the conservative side: blamed on the copy)."""
        mine: set[bytes] = set()  # blocks this session's prefetches uploaded
        if info is not None:
            for stall in (
                self.core.stalls.active_of(info.session_id),
                self.core.stalls.last.get(info.session_id),
            ):
                if stall is not None:
                    mine.update(stall.prefetched)
        pool = self.core.pool if self.copied else None  # nothing copied on device: no lookups
        n_local = max(int(local_tokens), 0) // self.core.block_size
        hit = [bytes(h) for h in list(request.block_hashes)[:n_local]] if mine or pool is not None else []
        prefetched = copied = 0
        for h in hit:
            prefetched += h in mine
            block = pool.cached(h) if pool is not None else None
            copied += block is not None and self.copied.get(block.block_id) == h
        prev = self.provenance.get(request.request_id) or {}  # an earlier admission (preempted)
        failed_before = self.failed_copies.pop(info.session_id) if info is not None else None
        self.provenance[request.request_id] = {
            "device_tokens": int(local_tokens),
            "prefetched_tokens": prefetched * self.core.block_size,
            # Device hits on blocks a host copy wrote (this session's prefetch or anyone's copy).
            "copied_tokens": copied * self.core.block_size,
            "host_tokens": int(host_tokens),
            "prompt_tokens": int(getattr(request, "num_prompt_tokens", 0) or request.num_tokens),
            # > 1: preempted and admitted again (the latest admission's counts)
            "admissions": int(prev.get("admissions", 0)) + 1,
            # The session's offloads / prefetches that failed since its previous admission, and
            # (filled in when the copy reports) this request's own demand load that failed and
            # was recomputed by vLLM. Non-zero only with faults: what a faulty copy could touch.
            "failed_copy_tokens": int(failed_before or 0) + int(prev.get("failed_copy_tokens", 0)),
            "failed_load_tokens": int(prev.get("failed_load_tokens", 0)),
        }

    def trace_failed_copy(self, job: Job) -> None:
        """Remember a failed copy for the provenance of the request it could have fed."""
        tokens = len(job.hashes) * self.core.block_size
        if job.kind == "load":  # this request's own load: vLLM recomputes those tokens
            prov = self.provenance.get(job.req_id or "")
            if prov is not None:
                prov["failed_load_tokens"] = prov.get("failed_load_tokens", 0) + tokens
        elif job.session_id is not None:  # the session's next request is the one to watch
            before = self.failed_copies.get(job.session_id) or 0
            self.failed_copies.put(job.session_id, before + tokens, 64)

    def fail_load(self, request: RequestView, block_ids: list[int], num_external_tokens: int) -> None:
        """Last resort when planning a demand load failed: make the workers report it failed."""
        first = self.usa_first if self.usa_req == request.request_id else 0
        n = -(-num_external_tokens // self.core.block_size)
        ids = block_ids[first : first + n] if block_ids else []
        self.core.stats.inc("demand_load.plan_failed")
        self.core.copies.outbox.append(CopyJob(0, "load", list(ids), [], request.request_id, invalid=True))
        # As a failed load: what vLLM computes from these blocks is not to be saved.
        self.core.copies.mark_suspect(request.request_id, first, block_ids[first:])

    def plan_load(
        self,
        request: RequestView,
        block_ids: list[int],
        num_external_tokens: int,
        pending: tuple[int, list[bytes], list[int]],
    ) -> None:
        """vLLM allocated ``block_ids`` for an admission with ``num_external_tokens`` from the host
        pool: the host → device copy of the blocks planned at ``get_num_new_matched_tokens``
        (``pending``) into them, pinned until the workers report it."""
        first, hashes, slots = pending
        n = num_external_tokens // self.core.block_size
        if n > len(hashes) or first + n > len(block_ids):
            raise RuntimeError(
                f"demand load plan mismatch for {request.request_id}: {n} blocks asked, "
                f"{len(hashes)} planned, {len(block_ids)} allocated"
            )
        assert self.core.pool is not None
        for h, slot in zip(hashes[:n], slots[:n], strict=True):
            if self.core.host.hash_of(slot) != h:
                raise RuntimeError(f"host slot {slot} no longer holds the planned block")
        blocks = [self.core.pool.block(b) for b in block_ids[first : first + n]]
        job = self.core.copies.new_job(
            "load", hashes[:n], list(range(first, first + n)), blocks, slots[:n], req_id=request.request_id
        )
        job.downstream = (first, tuple(block_ids[first:]))
        for bid in job.downstream[1]:
            self.loading[bid] = job.job_id
        self.core.host.pin_many(job.slots, job.owner)
        self.core.copies.outbox.append(job.to_wire())
        self.core.stats.inc("demand_load.requests")
        self.core.stats.inc("demand_load.blocks", n)
        self.core.stats.inc("tokens.from_host", n * self.core.block_size)


__all__ = ["DemandLoad"]
