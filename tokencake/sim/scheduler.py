"""vLLM 0.32's ``Scheduler.schedule``, modelled where it decides what KV costs, calling the KV
core where vLLM calls the connector.

One pass per step (``vllm/v1/core/sched/scheduler.py``):

1. **Running requests**, in order, while the token budget lasts: the rest of a prefill (a chunk
   of at most the budget) or one decode token. A request whose next blocks are not free asks the
   connector first (``has_pending_block_frees`` → :meth:`KVCore.free_for_running`): if held chains
   gave blocks back it waits for the next step and the pass schedules no further running request;
   else vLLM preempts by recompute (FCFS: the latest running request; priority: the lowest
   priority, then the latest arrival — a victim already scheduled this pass gives its tokens
   back) until the request fits or is the victim itself.
2. **Waiting requests**, unless the pass preempted one, while budget, ``max_num_seqs`` and
   blocks last, the head of the queue: ``_handle_blocked_waiting_request``
   (:meth:`Scheduler.proceeds`), the device prefix-cache hit (an unbroken chain from block 0, one
   token always left to compute) and the connector's ``get_num_new_matched_tokens`` — a False or
   a None pops the request, skipped this step, and queues it again when the pass ends (FCFS: at
   the head, in its order) — then vLLM's allocation test: the whole prompt must fit beside its
   hits, counting the hits that sit in the free queue (``full_sequence_must_fit``); a request
   that does not fit stops the pass and stays queued (not popped). Then the pop, the allocation
   (hits first, the loaded blocks, the step's chunk) and ``update_state_after_alloc``.

As vLLM's allocation does, the blocks that the step fills (computed or loaded) join the prefix
cache when they are allocated: a later admission of the same pass hits them.

:class:`TokenCakeScheduler` is TokenCake's ``--scheduler-cls``
(``tokencake/serving/vllm/scheduler.py``): the waiting queue by the spatial score, and a prefix-cache
reset that gives held chains back first. TokenCake's admission rules reach vLLM through the
connector's hook; :meth:`Scheduler.connector_admission` is the one place the pass asks them.

Its queue does what ``ScoredRequestQueue`` does under vLLM's pop, skip and prepend: every pop
(an admission, or a skip) counts the request's wait in its session's lag
(:meth:`SpatialScorer.admitted`: the last wait counts, once), and a request put back (skipped at
the pass's end, or preempted, its preemptions counted) is keyed again
(:meth:`SpatialScorer.order_key`: its session's lag, preemptions and KV credits then). What it
leaves out: vLLM's queue counts no wait of a request that arrived at 0 (an unknown arrival
there; every simulated arrival is known), and ties of key and arrival go to the lower request
number (vLLM's queue: the request id as a string). The connector's loads are synchronous (in
vLLM too), so vLLM's second queue, of waiting requests that hold blocks, stays empty: not modelled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokencake.events import RequestMeta
from tokencake.serving.kvcore.core import KVCore
from tokencake.serving.spatial import SpatialScorer
from tokencake.sim.cache import BlockCache
from tokencake.sim.profiles import HardwareProfile

if TYPE_CHECKING:
    from tokencake.sim.engine import Request

__all__ = ["Scheduler", "StepPlan", "TokenCakeScheduler", "cdiv"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class StepPlan:
    """What one pass scheduled: ``(request, new tokens)`` in order, and the requests it preempted."""

    __slots__ = ("preempted", "scheduled")

    def __init__(self) -> None:
        self.scheduled: list[tuple[Request, int]] = []
        self.preempted: list[Request] = []

    @property
    def tokens(self) -> int:
        return sum(n for _r, n in self.scheduled)


class Scheduler:
    """vLLM's scheduler (``fcfs`` or ``priority``); see the module docstring."""

    def __init__(
        self, profile: HardwareProfile, cache: BlockCache, core: KVCore | None, *, policy: str = "fcfs"
    ) -> None:
        self.profile = profile
        self.block_size = profile.block_size
        self.cache = cache
        self.core = core
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.local_hit_tokens = 0
        self.host_hit_tokens = 0
        self.computed_prompt_tokens = 0

    # ------------------------------------------------------------------ the waiting queue
    def enqueue(self, req: Request, *, front: bool = False) -> None:
        """FCFS: at the back (``front``: a preempted or skipped request, at the head); otherwise
        in :meth:`queue_key` order, the key taken now (a request put back is keyed again)."""
        if self.policy != "fcfs":
            req.queue_key = key = self.queue_key(req)
            i = len(self.waiting)
            while i > 0 and self.waiting[i - 1].queue_key > key:
                i -= 1
            self.waiting.insert(i, req)
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def queue_key(self, req: Request) -> tuple[float, float, int]:
        """vLLM's priority queue: (priority, arrival)."""
        return (float(req.priority), req.arrival, req.rid)

    def popped(self, req: Request, now: float) -> None:
        """A waiting request left the queue this pass: admitted, or skipped (it is queued again
        when the pass ends)."""

    # ------------------------------------------------------------------ one pass
    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        budget = self._schedule_running(plan, self.profile.max_batched_tokens)
        if not plan.preempted:
            self._schedule_waiting(plan, budget, now)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        cache, core = self.cache, self.core
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.total_tokens - req.num_computed, budget)
            need = cdiv(req.num_computed + n, self.block_size) - len(req.blocks)
            fits = True
            while need > cache.num_free:
                if core is not None and core.free_for_running():
                    fits = False  # held chains gave blocks back: it allocates next step
                    break
                victim = self._victim()
                at = self.running.index(victim)
                del self.running[at]
                if at < i:
                    i -= 1
                for entry in plan.scheduled:
                    if entry[0] is victim:  # scheduled earlier this pass: its tokens come back
                        plan.scheduled.remove(entry)
                        budget += entry[1]
                        break
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    fits = False
                    break
            if not fits:
                break
            if need > 0:
                req.blocks += cache.allocate(need)
            self._cache_blocks(req, req.num_computed + n)
            plan.scheduled.append((req, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int, now: float) -> None:
        cache, bs = self.cache, self.block_size
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.profile.max_num_seqs:
            req = self.waiting[0]
            total = req.total_tokens
            proceeds = self.proceeds(req)  # before the hit, as in vLLM (admission may make room)
            hit = cache.match(req.session.keys((total - 1) // bs)) if proceeds else []  # one token left
            external = self.connector_admission(req, len(hit) * bs) if proceeds else None
            if external is None:  # not this step: vLLM pops it, looks at the next one, queues it again
                skipped.append(self._dequeue(now))
                continue
            computed = len(hit) * bs + external
            n = min(total - computed, budget)
            evictable = sum(1 for b in hit if cache.ref[b] == 0)
            if cdiv(total, bs) - len(hit) + evictable > cache.num_free:
                break  # the whole prompt must fit (it stops the pass: vLLM's order)
            self._dequeue(now)
            cache.touch(hit)
            req.blocks = hit + cache.allocate(cdiv(computed + n, bs) - len(hit))
            req.cached_upto = len(hit)
            self._cache_blocks(req, computed + n)  # the loaded ones and the step's
            if req.admitted_at is None:
                req.admitted_at = now
                req.local_tokens = len(hit) * bs
                req.host_tokens = external
                req.computed_prompt_tokens = max(req.prompt_tokens - computed, 0)
                self.local_hit_tokens += req.local_tokens
                self.host_hit_tokens += req.host_tokens
            self.computed_prompt_tokens += max(total - computed, 0)
            if self.core is not None:
                self.core.update_state_after_alloc(req, list(req.blocks) if external else [], external)
            req.num_computed = computed
            self.running.append(req)
            plan.scheduled.append((req, n))
            budget -= n
        for req in reversed(skipped):
            self.enqueue(req, front=True)

    def proceeds(self, req: Request) -> bool:
        """vLLM's ``_handle_blocked_waiting_request``: whether the pass goes on with this waiting
        request (False: it is skipped this pass). Stock vLLM's always does here."""
        return True

    def connector_admission(self, req: Request, local_tokens: int) -> int | None:
        """Tokens the connector loads past the device hit (None: the request waits a step) — the
        one place the pass asks TokenCake about an admission (the connector's
        ``get_num_new_matched_tokens``; without TokenCake's scheduler class it also releases the
        holds the request needs the room of)."""
        if self.core is None:
            return 0
        return self.core.get_num_new_matched_tokens(req, local_tokens)

    def _cache_blocks(self, req: Request, tokens: int) -> None:
        """Publish the request's blocks that are full once its first ``tokens`` tokens are
        computed (or loaded) in the prefix cache, as vLLM's allocation does for the step's tokens."""
        full = min(tokens, req.total_tokens) // self.block_size
        upto = min(full, len(req.blocks))
        for i in range(req.cached_upto, upto):
            self.cache.cache(req.blocks[i], req.session.key(i))
        req.cached_upto = max(req.cached_upto, upto)

    def _victim(self) -> Request:
        """FCFS: the latest running request; otherwise the lowest priority, then the latest."""
        if self.policy != "fcfs":
            return max(self.running, key=lambda r: (r.priority, r.arrival, r.rid))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        """vLLM's preemption by recompute: the blocks go (tail first), the request waits at the
        head of the queue."""
        self.cache.release(list(reversed(req.blocks)))
        req.blocks = []
        req.num_computed = 0
        req.cached_upto = 0
        req.preemptions += 1
        self.preemptions += 1
        self.enqueue(req, front=True)

    def _dequeue(self, now: float) -> Request:
        """vLLM's ``pop_request`` of the queue's head (:meth:`popped` hears of it)."""
        req = self.waiting.popleft()
        self.popped(req, now)
        return req

    # ------------------------------------------------------------------ prefix-cache reset
    def reset_prefix_cache(self, *, reset_connector: bool = True) -> bool:
        """vLLM's reset: the device prefix cache is dropped only when no block is in use (every
        block keeps its place in the free queue, without its hash); the connector is told in
        any case. True when both succeeded."""
        ok = self.cache.num_used == 0
        if ok:
            self.cache.uncache(range(self.cache.num_blocks))
        if reset_connector and self.core is not None:
            ok = self.core.reset_cache() and ok
        return ok


class TokenCakeScheduler(Scheduler):
    """TokenCake's ``--scheduler-cls``: waiting requests by the spatial score, the core's admission
    control before each admission, and a reset that gives held chains back first (refused while
    copies pin device blocks)."""

    def __init__(
        self,
        profile: HardwareProfile,
        cache: BlockCache,
        core: KVCore | None,
        *,
        scorer: SpatialScorer,
        clock: Callable[[], float],
    ) -> None:
        super().__init__(profile, cache, core, policy="spatial")
        self.scorer = scorer
        #: The engine's clock (the score ages a request by its wait).
        self.clock = clock
        if core is not None:  # as the real scheduler class: admission control on
            core.enable_admission_control(self.running_need)

    def proceeds(self, req: Request) -> bool:
        """The core's admission control decides (``KVCore.admit``), as in the real scheduler's
        ``_handle_blocked_waiting_request``."""
        return self.core is None or self.core.admit(req, len(self.running))

    def running_need(self) -> int:
        """Blocks the running requests still need this step, in their order and token budget (the
        real scheduler's ``_running_need``): requests scheduled this pass hold theirs already."""
        budget, need = self.profile.max_batched_tokens, 0
        for r in self.running:
            if budget <= 0:
                break
            n = min(r.total_tokens - r.num_computed, budget)
            if n <= 0:
                continue
            need += max(0, cdiv(r.num_computed + n, self.block_size) - len(r.blocks))
            budget -= n
        return need

    def queue_key(self, req: Request) -> tuple[float, float, int]:
        """The spatial score's order key (``SpatialScorer.order_key``) from what a trace knows of
        the node (``Request.meta``), its preemptions and whether the core holds its session's
        chain on device or has it saved on host."""
        sid = req.session.session_id
        held = self.core is not None and self.core.holds_kv(sid)
        saved = not held and self.core is not None and self.core.saved_kv(sid)
        key = self.scorer.order_key(
            req.meta,
            arrival=req.arrival,
            preemptions=req.preemptions,
            now=self.clock(),
            retained=held,
            saved=saved,
        )
        return (key, req.arrival, req.rid)

    def popped(self, req: Request, now: float) -> None:
        """The request's wait counts in its session's lag at every pop, a pass that skips it
        included (``ScoredRequestQueue._count_wait``: the last wait counts, once), so the key it
        gets when it is queued again sees the slack its branch spent."""
        meta: RequestMeta | None = req.meta
        self.scorer.admitted(meta, request_id=req.request_id, waited_s=now - req.arrival)

    def reset_prefix_cache(self, *, reset_connector: bool = True) -> bool:
        core = self.core
        if core is not None:
            if core.device_copies_in_flight():
                return False
            if not self.running:
                core.release_device_holds()
        return super().reset_prefix_cache(reset_connector=reset_connector)
