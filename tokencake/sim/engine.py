"""The engine model: vLLM v1's continuous-batching step loop where it decides what KV costs.

Per step, as ``vllm/v1/core/sched/scheduler.py`` does it: running requests first (a decode token
each, or the next chunk of a prefill), preempting the latest running request by recompute when a
block cannot be allocated; then waiting requests in FCFS order while the token budget and the
blocks last (a request that does not fit stops the queue). A waiting request's prompt is served
from the device prefix cache (an unbroken chain of cached blocks from block 0), then from the
extension's host pool (a demand load), and the rest is computed. The step's time comes from the
hardware profile; the extension (``tokencake.sim.extension``) sees the same hooks as the real
connector: a new request, admission, the step, a finished request, copies completing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokencake.events import GraphMeta, RequestMeta
from tokencake.serving.spatial import SpatialScorer, admission_weights
from tokencake.sim.cache import BlockCache
from tokencake.sim.profiles import HardwareProfile

if TYPE_CHECKING:
    from tokencake.sim.extension import KVExtension

__all__ = ["SCHEDULINGS", "Engine", "Request", "Session"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Session:
    """One agent's growing conversation; block ``i`` has a stable key (shared-prefix blocks: the group's)."""

    session_id: str
    agent_type: str
    block_size: int
    prefix_group: str | None = None
    prefix_tokens: int = 0

    def key(self, i: int) -> bytes:
        """Block ``i``'s prefix key (bytes, like vLLM's block hashes: the host pool indexes them)."""
        if self.prefix_group is not None and (i + 1) * self.block_size <= self.prefix_tokens:
            return f"{self.prefix_group}\x00{i}".encode()
        return f"{self.session_id}\x00{i}".encode()

    def keys(self, n: int, start: int = 0) -> list[bytes]:
        return [self.key(i) for i in range(start, n)]


@dataclass(eq=False)
class Request:
    rid: int
    session: Session
    prompt_tokens: int
    output_tokens: int
    arrival: float
    #: The tool the agent calls after this reply (``next_stall``): (tool, hint seconds).
    next_tool: tuple[str, float] | None = None
    #: vLLM ``priority`` (lower first; used under ``scheduling="priority"``).
    priority: int = 0
    num_computed: int = 0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    cached_upto: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    #: Prompt tokens served by the device prefix cache / the host pool / computed, at admission.
    local_tokens: int = 0
    host_tokens: int = 0
    computed_prompt_tokens: int = 0
    #: The first time the scheduler looked at it (the connector's "arrival" in the queue).
    seen_at: float | None = None
    #: Blocks it counts for in the queue's demand while it waits (0 when not queued).
    queued_blocks: int = 0
    #: It waited at least one step for the critical reserve.
    reserve_waited: bool = False
    #: Its app (the spatial score's app age); "" = a plain request.
    run_id: str = ""
    #: Its place in the waiting queue (lowest first), set when queued.
    queue_key: tuple[float, float, int] = (0.0, 0.0, 0)

    @property
    def total_tokens(self) -> int:
        """Tokens whose KV the request needs now (the prompt plus what it generated so far)."""
        return self.prompt_tokens + self.generated

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.total_tokens - (1 if self.generated else 0)


#: Admission orders the engine models (``Engine(scheduling=...)``).
SCHEDULINGS: tuple[str, ...] = ("fcfs", "priority", "spatial")


class Engine:
    def __init__(
        self,
        profile: HardwareProfile,
        *,
        device_blocks: int | None = None,
        extension: KVExtension | None = None,
        scheduling: str = "fcfs",
    ) -> None:
        """``scheduling``: ``fcfs`` (vLLM's default), ``priority`` (``--scheduling-policy
        priority``: the queue by (priority, arrival), the preemption victim the lowest priority) or
        ``spatial`` (TokenCake's spatial scheduler: the queue by the spatial score, the victim as
        under ``priority``; ``docs/simulation.md`` §2 says what of it is modelled)."""
        if scheduling not in SCHEDULINGS:
            raise ValueError(f"scheduling must be one of {', '.join(SCHEDULINGS)}, got {scheduling!r}")
        self.scheduling = scheduling
        self.scorer = SpatialScorer()
        self.profile = profile
        self.block_size = profile.block_size
        self.cache = BlockCache(device_blocks or profile.device_blocks)
        self.ext = extension
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.now = 0.0
        self.steps = 0
        self.busy_s = 0.0
        self.preemptions = 0
        self.prompt_tokens = 0
        self.computed_prompt_tokens = 0
        self.local_hit_tokens = 0
        self.host_hit_tokens = 0
        self.scheduled_tokens: deque[tuple[float, int]] = deque()
        self.step_durations: deque[float] = deque(maxlen=64)
        self._wb = 0
        self._scheduled_sum = 0
        if extension is not None:
            extension.bind(self)
            # The spatial scheduler's eviction side goes with its admission order (as the
            # connector's ``critical_last``, unless the options keep the order only).
            extension.critical_last = scheduling == "spatial" and extension.opts.critical_last
            # ...and its admission order is the KV policy's (Continuum's differs), as the connector's.
            self.scorer = SpatialScorer(
                admission_weights(extension.opts.admission or extension.policy.admission)
            )

    # ------------------------------------------------------------------ requests
    def submit(self, req: Request) -> None:
        self._enqueue(req)
        self.prompt_tokens += req.prompt_tokens
        if self.ext is not None:
            self.ext.on_new_request(req)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def idle_until(self, t: float) -> None:
        """Nothing to compute: time passes (the extension still acts: wake-ups, prefetches)."""
        self.now = max(self.now, t)
        if self.ext is not None:
            self.ext.tick(self.now)
            self.ext.after_step(self.now, 0.0)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Request]:
        """Schedule, run one forward, and return the requests that finished in it."""
        now = self.now
        scheduled, loads = self._schedule(now)
        if self.ext is not None:
            self.ext.tick(now)
        dt = self._step_time(scheduled)
        sync_copy = self.ext.step_copy_s(loads) if self.ext is not None else 0.0
        dt += sync_copy
        self.now = now + dt
        self.steps += 1
        self.busy_s += dt
        self.step_durations.append(dt)
        tokens = sum(n for _r, n in scheduled)
        self.scheduled_tokens.append((now, tokens))
        self._scheduled_sum += tokens
        while self.scheduled_tokens and now - self.scheduled_tokens[0][0] > 10.0:
            self._scheduled_sum -= self.scheduled_tokens.popleft()[1]
        finished = []
        for req, n in scheduled:
            req.num_computed += n
            self._cache_full_blocks(req)
            if req.num_computed >= req.total_tokens - (1 if req.generated else 0):
                # The step that completes the prefill samples the first token; each decode step one.
                req.generated += 1
                if req.first_token_at is None:
                    req.first_token_at = self.now
                if req.generated >= req.output_tokens:
                    finished.append(req)
        if self.ext is not None:
            self.ext.after_step(self.now, dt)
        for req in finished:
            req.finished_at = self.now
            self.running.remove(req)
            if self.ext is not None:
                self.ext.on_finished(req)
            self.cache.release(list(reversed(req.blocks)))  # the tail goes first
            req.blocks = []
        return finished

    def _cache_full_blocks(self, req: Request) -> None:
        full = min(req.num_computed, req.prompt_tokens + req.output_tokens) // self.block_size
        for i in range(req.cached_upto, min(full, len(req.blocks))):
            self.cache.cache(req.blocks[i], req.session.key(i))
        req.cached_upto = max(req.cached_upto, min(full, len(req.blocks)))

    def mean_step_s(self, last: int = 64) -> float:
        """Mean duration of the last ``last`` steps (0 before the first)."""
        recent = list(self.step_durations)[-last:]
        return sum(recent) / len(recent) if recent else 0.0

    def _step_time(self, scheduled: list[tuple[Request, int]]) -> float:
        p = self.profile
        if not scheduled:
            return p.step_s
        prefill = ctx = decode = decode_ctx = 0
        for req, n in scheduled:
            if req.generated and n == 1 and req.num_computed >= req.total_tokens - 1:
                decode += 1
                decode_ctx += req.num_computed
            else:
                prefill += n
                ctx += n * (req.num_computed + n // 2)
        return (
            p.step_s
            + p.prefill_s_per_token * prefill
            + p.attn_s_per_token_ctx * ctx
            + p.decode_s_per_seq * decode
            + p.decode_s_per_ctx_token * decode_ctx
        )

    # ------------------------------------------------------------------ scheduler
    def _schedule(self, now: float) -> tuple[list[tuple[Request, int]], int]:
        budget = self.profile.max_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = short = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.total_tokens - req.num_computed, budget) if req.prefilling else 1
            need = cdiv(req.num_computed + n, self.block_size) - len(req.blocks)
            ok = True
            while need > self.cache.num_free:
                if self.ext is not None and self.ext.free_for_running():
                    # vLLM's ``has_pending_block_frees``: held chains gave blocks back; this
                    # request (and the rest of the pass) waits a step instead of a preemption.
                    short, ok = True, False
                    break
                victim = self._victim()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    ok = False
                    break
            if not ok:
                break
            if need > 0:
                req.blocks += self.cache.allocate(need)
            scheduled.append((req, n))
            budget -= n
            i += 1
        loads = 0
        if preempted or short:
            return scheduled, loads
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.profile.max_num_seqs:
            req = self.waiting[0]
            if req.seen_at is None:
                req.seen_at = now
            total = req.total_tokens
            limit = (total - 1) // self.block_size  # leave one token to compute
            hit = self.cache.match(req.session.keys(limit))
            host: list[Any] = []
            if self.ext is not None:
                found = self.ext.host_match(req, len(hit), limit)
                if found is None:  # its session's prefetch is being copied: ask again next step
                    skipped.append(self._dequeue())
                    continue
                host = found
            computed = (len(hit) + len(host)) * self.block_size
            n = min(total - computed, budget)
            want = cdiv(computed + n, self.block_size) - len(hit)
            need = want + sum(1 for b in hit if self.cache.ref[b] == 0)
            if self.ext is not None and self.ext.make_room(req, need):
                # It would fit only with the critical reserve lent, or in room kept for a return.
                skipped.append(self._dequeue())
                continue
            if need > self.cache.num_free:
                break
            if self.ext is not None and self.ext.spare_critical_chains(req, need, hit):
                skipped.append(self._dequeue())  # it waits a step for the critical reserve
                continue
            self._dequeue()
            self.scorer.admitted(self._meta(req), request_id=str(req.rid), waited_s=now - req.arrival)
            self.cache.touch(hit)
            req.blocks = hit + self.cache.allocate(want)
            if self.ext is not None and self.cache.last_evicted:
                self.ext.on_allocated(req, self.cache.last_evicted)
            req.num_computed = computed
            req.cached_upto = len(hit)
            if req.admitted_at is None:
                req.admitted_at = now
                req.local_tokens = len(hit) * self.block_size
                req.host_tokens = len(host) * self.block_size
                req.computed_prompt_tokens = max(req.prompt_tokens - computed, 0)
                self.local_hit_tokens += req.local_tokens
                self.host_hit_tokens += req.host_tokens
            self.computed_prompt_tokens += max(total - computed, 0)
            if host and self.ext is not None:
                self.ext.load(req, len(hit), host)
                loads += len(host)
                self._cache_full_blocks(req)  # loaded blocks hold their KV once the step's load ran
            if self.ext is not None:
                self.ext.on_admitted(req, len(hit), len(host))
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        for req in reversed(skipped):
            self._enqueue(req, front=True)
        return scheduled, loads

    def _victim(self) -> Request:
        """FCFS: the latest running request; priority (and spatial, which keeps vLLM's victim
        choice): the lowest priority, then the latest."""
        if self.scheduling != "fcfs":
            return max(self.running, key=lambda r: (r.priority, r.arrival, r.rid))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        """vLLM's preemption by recompute: the blocks go, the request waits at the queue's head."""
        self.running.remove(req)
        self.cache.release(list(reversed(req.blocks)))
        req.blocks = []
        req.num_computed = 0
        req.cached_upto = 0
        req.preemptions += 1
        self.preemptions += 1
        self._enqueue(req, front=True)

    # ------------------------------------------------------------------ what the extension reads
    def alloc_rate(self) -> float:
        """Blocks allocated per second over the last 10 s (scheduled tokens / block size)."""
        if len(self.scheduled_tokens) < 2:
            return 0.0
        span = max(self.now - self.scheduled_tokens[0][0], 1e-6)
        return self._scheduled_sum / self.block_size / span

    def step_wait_s(self) -> float:
        total = sum(self.step_durations)
        return sum(d * d for d in self.step_durations) / (2 * total) if total > 0 else 0.0

    def waiting_blocks(self, exclude: Request | None = None) -> int:
        """Blocks the queued requests need (the connector's ``_waiting`` sum), kept incrementally."""
        if exclude is not None and exclude.queued_blocks:
            return self._wb - exclude.queued_blocks
        return self._wb

    def _enqueue(self, req: Request, *, front: bool = False) -> None:
        req.queued_blocks = cdiv(req.total_tokens, self.block_size)
        self._wb += req.queued_blocks
        if self.scheduling != "fcfs":
            req.queue_key = key = self._queue_key(req)
            i = len(self.waiting)
            while i > 0 and self.waiting[i - 1].queue_key > key:
                i -= 1
            self.waiting.insert(i, req)
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def _queue_key(self, req: Request) -> tuple[float, float, int]:
        """priority: (priority, arrival); spatial: the score's order key (``spatial.order_key``) from
        what a trace knows of the node — on the critical path when its priority is 0, else its
        priority as seconds of slack — its app, its preemptions and whether its chain is held on
        device or saved on host."""
        if self.scheduling == "priority":
            return (float(req.priority), req.arrival, req.rid)
        meta = self._meta(req)
        sid = req.session.session_id
        held = self.ext is not None and self.ext.holds_kv(sid)
        saved = not held and self.ext is not None and self.ext.saved_kv(sid)
        key = self.scorer.order_key(
            meta, arrival=req.arrival, preemptions=req.preemptions, now=self.now, retained=held, saved=saved
        )
        return (key, req.arrival, req.rid)

    @staticmethod
    def _meta(req: Request) -> RequestMeta | None:
        """What a trace knows of the request's node: on the critical path when its priority is 0,
        else its priority as seconds of slack; None for a plain request."""
        if not req.run_id:
            return None
        graph = GraphMeta(on_critical_path=req.priority == 0, slack_s=float(req.priority))
        return RequestMeta(session_id=req.session.session_id, run_id=req.run_id, node="", graph=graph)

    def _dequeue(self) -> Request:
        req = self.waiting.popleft()
        self._wb -= req.queued_blocks
        req.queued_blocks = 0
        return req
