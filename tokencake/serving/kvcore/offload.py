"""Offload planning: a session's usable chain, what the policy sees of it, host victims for a full pool,
and the device → host copy (at stall begin or, announced, when the request finishes).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tokencake.serving.gate import GateInput, remaining_s
from tokencake.serving.host_pool import HostPoolExhausted, preemption_victims
from tokencake.serving.kvcore.records import STALL_OWNER, Job, ReqInfo, stall_owner
from tokencake.serving.policies import Plan, PolicyView
from tokencake.serving.spatial import demote_rank

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

log = logging.getLogger("vllm.tokencake")


class OffloadPlanning:
    """Offload planning (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core

    def chain(self, hashes: tuple[bytes, ...] | list[bytes]) -> list[tuple[int, bytes, Any, int | None]]:
        """``(position, hash, device block or None, host slot or None)`` of the usable chain prefix.

        A hit needs an unbroken chain from block 0, so the scan stops at the first block that is
        neither cached on device, nor on host, nor being copied there.
        """
        assert self.core.pool is not None
        chain: list[tuple[int, bytes, Any, int | None]] = []
        for i, h in enumerate(hashes):
            dev = self.core.pool.cached(h)  # (bad KV a failed load left is uncached)
            slot = self.core.host.lookup(h)
            if dev is None and slot is None:
                break
            chain.append((i, h, dev, slot))
        return chain

    def _gate_input(
        self, chain: list, predicted_s: float, elapsed_s: float, known: bool, now: float, session_id: str = ""
    ) -> GateInput:
        on_host = sum(1 for _i, h, _d, slot in chain if slot is not None or h in self.core.copies.filling)
        left = remaining_s(predicted_s, elapsed_s, self.core.gate.overdue_factor)
        # Only a pool short of room needs victims, and only as many as are short.
        preemptible = len(self._victims_for(chain, len(chain) - on_host, now + left, session_id, now))
        return GateInput(
            predicted_s=predicted_s,
            num_blocks=len(chain),
            block_bytes=self.core.block_bytes,
            device_usage=self.core.steps.eviction_risk(chain, left, now),
            num_waiting=len(self.core.requests.waiting),
            host_free_blocks=self.core.host.num_free,
            num_on_host=on_host,
            host_reclaimable_blocks=self.core.host.num_reclaimable,
            host_preemptible_blocks=preemptible,
            elapsed_s=elapsed_s,
            session_known=known,
        )

    def _victims_for(
        self, chain: list, n: int, returns_at: float | None, session_id: str, now: float
    ) -> list[int]:
        """Victims a save of ``n`` blocks of ``chain`` needs beyond free and unheld slots."""
        short = n - self.core.host.num_free - self.core.host.num_reclaimable
        if returns_at is None or short <= 0:
            return []
        own = {h for _i, h, _d, _s in chain}
        return self._host_victims(returns_at, session_id, now, limit=short, own=own)

    def _host_victims(
        self,
        returns_at: float,
        session_id: str,
        now: float,
        *,
        limit: int | None = None,
        own: set[bytes] | frozenset[bytes] = frozenset(),
    ) -> list[int]:
        """Host slots a save for a session returning at ``returns_at`` may take (``preempts_host``).

        Belady's rule with the events' forecasts: when the pool is full, keep the copies of the
        sessions that return soonest. Candidates are offloaded stalls predicted to return later
        than ``returns_at`` (their remaining time stretched as the gate's when overdue), taken in
        eviction-queue order (non-critical first, latest return first), each chain tail first (a hit
        needs the chain from block 0, so the head is the last to go). Never a slot that anything
        else owns — a copy in flight (``job:``), a stall returning sooner, an ended stall whose next
        request will load it — nor a slot planned for a demand load, nor the copies of a session
        whose request waits or whose prefetch runs, nor a block of the saving session's own chain
        (``own``: a shared prefix it needs too). At most ``limit`` slots (None: all).
        """
        if not self.core.policy.preempts_host or not self.core.stalls.active:
            return []
        waiting = self.core.requests.waiting_sessions()
        planned = {
            slot for _first, _hashes, slots in self.core.demand.pending_load.values() for slot in slots
        }
        later: list[tuple[tuple[int, float], str, tuple[bytes, ...]]] = []
        for stall in self.core.stalls.active.values():
            if (
                not stall.offloaded
                or stall.ended_at is not None
                or stall.session_id == session_id
                or stall.session_id in waiting
                or stall.session_id in self.core.copies.prefetching
            ):
                continue
            back = now + remaining_s(stall.predicted_s, now - stall.begin_at, self.core.gate.overdue_factor)
            if back > returns_at:
                rank = demote_rank(critical=stall.critical and self.core.critical_last, returns_at=back)
                later.append((rank, stall_owner(stall.stall_id), stall.hashes))
        return preemption_victims(self.core.host, later, limit=limit, own=own, skip=planned) if later else []

    def view(
        self,
        chain: list,
        predicted_s: float,
        elapsed_s: float,
        known: bool,
        now: float,
        *,
        session_id: str,
        agent_type: str,
        tool: str | None,
        at_finish: bool,
        announced: bool,
    ) -> PolicyView:
        """Everything a policy may weigh for one session (see ``tokencake.serving.policies``)."""
        assert self.core.pool is not None
        gate = self._gate_input(chain, predicted_s, elapsed_s, known, now, session_id)
        on_host = gate.num_on_host
        return PolicyView(
            gate=gate,
            session_id=session_id,
            agent_type=agent_type,
            tool=tool,
            device_blocks=self.core.pool.num_blocks,
            device_free_blocks=self.core.pool.num_free(),
            waiting_blocks=sum(self.core.requests.waiting.values()),
            recompute_s=self.core.profile.recompute_s(len(chain) * self.core.block_size),
            d2h_s=self.core.transfer.estimate("d2h", max(len(chain) - on_host, 0) * self.core.block_bytes),
            h2d_s=self.core.transfer.estimate("h2d", len(chain) * self.core.block_bytes),
            at_finish=at_finish,
            announced=announced,
            kept=session_id in self.core.holds.kept,
            now_s=now,
            step_s=self.core.steps.mean_step_s(),
        )

    def count_plan(self, where: str, plan: Plan) -> None:
        self.core.stats.inc(f"policy.{where}.{plan.action}")
        self.core.stats.inc(f"policy.reason.{plan.reason}")

    def plan_offload(
        self, chain: list, *, stall_id: str | None, session_id: str, returns_at: float | None = None
    ) -> Job | None:
        """Pin the chain's device blocks that have no host copy yet and queue their copy.

        With ``returns_at`` (the session's predicted return) a full host pool yields the copies of
        sessions returning later (:meth:`_host_victims`). Raises :class:`HostPoolExhausted` when
        the host cannot take them (nothing is pinned then).
        """
        assert self.core.pool is not None
        todo = [
            (i, h, dev)
            for i, h, dev, slot in chain
            if slot is None and dev is not None and h not in self.core.copies.filling
        ]
        if not todo:
            return None
        # The slots are allocated for the job about to be created (owner = its id), all or nothing.
        victims = self._victims_for(chain, len(todo), returns_at, session_id, self.core.clock())
        losers = {slot: self.core.host.owners(slot) for slot in victims}
        slots = self.core.host.allocate(len(todo), Job.owner_of(self.core.copies.next_job), victims)
        taken = [slot for slot in slots if slot in losers]
        if taken:
            self._after_host_preemption(taken, losers)
        blocks = [dev for _i, _h, dev in todo]
        self.core.pool.pin(blocks)
        self.core.holds.counts.forget()  # a held block may be among them (``HoldCounts``)
        job = self.core.copies.new_job(
            "offload",
            [h for _i, h, _d in todo],
            [i for i, _h, _d in todo],
            blocks,
            slots,
            stall_id=stall_id,
            session_id=session_id,
        )
        job.device_owned = True
        for h in job.hashes:
            self.core.copies.filling[h] = job.job_id
        self.core.copies.outbox.append(job.to_wire())
        self.core.stats.inc("offload.jobs")
        return job

    def _after_host_preemption(self, taken: list[int], losers: dict[int, frozenset[str]]) -> None:
        """Stalls lost the tail of their host copy to a session returning sooner: their device
        blocks are no longer safe to evict first (what is left on device is all they have).
        They go back in the order of the slots taken, a slot's owners by id (each moves its
        chain to the back of the free queue: an order independent of the string hash seed)."""
        self.core.stats.inc("host.preempted_blocks", len(taken))
        hit = dict.fromkeys(owner for slot in taken for owner in sorted(losers[slot]))
        for owner in hit:
            is_stall = owner.startswith(STALL_OWNER)
            stall = self.core.stalls.active.get(owner.removeprefix(STALL_OWNER)) if is_stall else None
            if stall is not None:
                self.core.stats.inc("host.preempted_stalls")
                self.core.eviction.promote(stall)

    def on_finished(self, info: ReqInfo | None, hashes: list[bytes], now: float) -> None:
        """A request finished: ask the policy while vLLM still holds its blocks.

        The blocks of a request that just finished sit at the safe end of the eviction queue, but
        under pressure they can be evicted before ``stall_begin`` reaches the engine; the session
        would then only get back the part an earlier turn had saved. Deciding here, with the
        announced tool's forecast, makes the save (or the pin) independent of that race. Policies
        that use no events (offload-all) decide here for every request.
        """
        if self.core.pool is None or not hashes:
            return
        nxt = info.next_stall if info is not None else None
        if nxt is None and self.core.policy.uses_events:
            return
        chain = self.chain(hashes)
        # The request reused its prefix's host copies: most recently used, head last (an LRU tier
        # must lose a chain's tail before its head; a hit needs the chain from block 0).
        reused = [slot for _i, _h, _d, slot in reversed(chain) if slot is not None]
        if reused:
            self.core.host.touch(reused)
        if not self.core.opts.offload and not self.core.policy.uses_events:
            return
        agent_type = info.agent_type if info is not None else ""
        predicted, tool = 0.0, None
        if nxt is not None:
            predicted = self.core.forecaster.predict(agent_type, nxt.tool, nxt.predicted_s).seconds
            tool = nxt.tool
        session_id = info.session_id if info is not None else ""
        view = self.view(
            chain,
            predicted,
            0.0,
            True,
            now,
            session_id=session_id,
            agent_type=agent_type,
            tool=tool,
            at_finish=True,
            announced=nxt is not None,
        )
        plan = self.core.policy.on_finished(view)
        if plan.action == "offload" and not (self.core.opts.offload and self.core.opts.early_save):
            plan = Plan("none", "disabled")  # the at-finish save is switched off: the stall copies
        self.core.stats.inc(f"early_save.decision.{plan.reason}")
        self.count_plan("finish", plan)
        if session_id:
            self.core.stalls.finish_decision.put(session_id, plan.reason, 1)
        if plan.action == "keep" and session_id:
            self.core.holds.keep(session_id, chain, now + plan.keep_s, now)
            return
        # "discard" needs idle blocks: the request still holds them; the stall applies it.
        if plan.action != "offload":
            return
        try:
            job = self.plan_offload(chain, stall_id=None, session_id=session_id, returns_at=now + predicted)
        except HostPoolExhausted:
            self.core.stats.inc("early_save.host_pool_full")
            if session_id:
                self.core.stalls.finish_decision.put(session_id, "host_pool_full", 1)
            return
        if job is not None:
            self.core.stats.inc("early_save.jobs")
            self.core.stats.inc("early_save.blocks", len(job.hashes))


__all__ = ["OffloadPlanning"]
