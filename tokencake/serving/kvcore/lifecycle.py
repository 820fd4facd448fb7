"""The stall state machine: begin (ask the policy, plan the offload, plan the return), join (a concurrent
tool call of the same session), end, expiry, and retryable decisions asked again while the tool runs.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from tokencake.events import StallBegin, StallEnd
from tokencake.serving.gate import remaining_s
from tokencake.serving.host_pool import HostPoolExhausted
from tokencake.serving.kvcore.records import Stall, stall_owner
from tokencake.serving.policies import Plan
from tokencake.serving.sessions import StallTransition, hashes_nbytes
from tokencake.serving.stall_calls import ToolCall

if TYPE_CHECKING:
    from tokencake.serving.kvcore.core import KVCore

log = logging.getLogger("vllm.tokencake")


class StallLifecycle:
    """The stall state machine (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core
        self.was_waiting = False  # whether requests waited at the last step (re-ask on change)

    def drain(self, now: float) -> None:
        for tr in self.core.sessions.drain():
            try:
                self._on_transition(tr, now)
            except Exception:
                self.core.stats.inc("errors.transition")
                log.exception("TokenCake: stall transition %s failed", tr.kind)

    def _on_transition(self, tr: StallTransition, now: float) -> None:
        if tr.kind == "begin":
            self._on_begin(tr, now)
            return
        stall = self.core.stalls.of_call(tr.stall_id)
        if stall is None:
            return
        if tr.kind == "expired":  # by the tracker's safety net (it expired the call itself)
            self.expire_calls(stall, [tr.stall_id], tr.detail or "expired", tracked=True)
            return
        self._end_call(stall, tr.stall_id, tr.at, tr.event)

    def _end_call(self, stall: Stall, call_id: str, at: float, ev: StallBegin | StallEnd | None) -> None:
        """An open call of ``stall`` ended at ``at`` (``ev``: its end, which teaches the forecasts);
        the stall ends with its last open call."""
        call = self.core.stalls.leave(stall, call_id)
        assert call is not None
        if isinstance(ev, StallEnd) and stall.known:
            # Only sessions that sent a request teach the shared forecasts: events alone,
            # for sessions that do not exist, must not steer every tenant's tool durations.
            self.core.policy.observe_stall_end(call.key, ev.duration_s)
            self.core.forecaster.observe(call.agent_type, call.tool, ev.duration_s, call.predicted_s)
            self.core.stats.observe("forecast.error_s", call.predicted_s - ev.duration_s)
            # The call as the server saw it minus as the client timed it: event delivery lag.
            self.core.stats.observe("stalls.server_minus_client_s", (at - call.begin_at) - ev.duration_s)
        if stall.calls.shared and self.core.planner.is_open(stall.stall_id):
            self.core.planner.observe_return(call.key, call.begin_at, call.predicted_s, at)
        if stall.calls.open:  # another call of the session still runs: the chain stays idle
            self._retime(stall)
            return
        self.core.stalls.pop(stall)
        stall.ended_at = at
        held = self.core.holds.kept.get(stall.session_id)
        if held is not None:
            held.until = min(held.until, at + self.core.opts.keep_after_end_s)
        self._finish_stall(stall)
        # The tools are back: the idle device blocks are the next to be used, not evicted.
        self.core.eviction.promote(stall)
        plan = self.core.planner.get(stall.stall_id)
        learn = not stall.calls.shared  # a shared stall's calls were learned one by one
        if plan is not None and plan.state in ("waiting", "on_device"):
            if plan.state == "on_device" and not stall.topup and not self.core.uploads.chain_on_device(stall):
                # A stall longer than predicted: what was prefetched (or still cached) at the
                # due time was evicted since; the planner makes it due again at the end. (A
                # chain uploaded in part is topped up instead: ``try_topup``.)
                self.core.planner.mark_evicted(stall.stall_id, now=at, retry=False)
            elif plan.state == "waiting" and plan.due_at > at:
                self.core.stats.inc("prefetch.triggered_by_end")  # an end earlier than predicted
            self.core.planner.end(stall.stall_id, now=at, learn=learn)
        elif plan is not None:
            self.core.planner.end(stall.stall_id, now=at, learn=learn)

    def _on_begin(self, tr: StallTransition, now: float) -> None:
        ev = tr.event
        assert isinstance(ev, StallBegin)
        agent_type = ev.agent_type or ev.node
        fc = self.core.forecaster.predict(agent_type, ev.tool, ev.predicted_s, ev.stages)
        self.core.stats.inc(f"forecast.source.{fc.source}")
        hashes = tuple(tr.blocks.block_hashes) if tr.blocks is not None else ()
        shared = self.core.stalls.active_of(ev.session_id)
        if shared is not None:
            if hashes == shared.hashes:
                self._join(shared, ToolCall(ev.stall_id, agent_type, ev.tool, tr.at, fc.seconds), now)
                return
            self._end_outlived(shared, tr.at)
        stall = Stall(
            ev.stall_id,
            ev.session_id,
            agent_type,
            ev.tool,
            tr.at,
            fc.seconds,
            tuple(hashes),
            known=tr.blocks is not None,
            critical=bool(self.core.critical.sessions.get(ev.session_id)),
            finish_decision=self.core.stalls.finish_decision.pop(ev.session_id),
        )
        stall.lead_s = (
            self.core.transfer.estimate("h2d", len(hashes) * self.core.block_bytes)
            + self.core.opts.prefetch_margin_s
        )
        self.core.stalls.add(stall)
        self._evaluate(stall, now)
        self.core.stalls.release_finish_pins(stall.session_id)  # the stall pins what it keeps

    def _end_outlived(self, stall: Stall, at: float) -> None:
        """A tool call begins on another chain than the session's open stall: the session ran a
        turn since that stall began (the call's begin came after the turn's request), so the
        stall's calls are over — it must not take the new chain's place. Each open call ends
        here: with its end if the tracker has it (still queued), else on the client's behalf
        (``events.inferred_end``), as if the session's next request had ended it."""
        for call_id in list(stall.calls.open):
            rec = self.core.sessions.stall(call_id)
            end: StallEnd | None = rec.end if rec is not None else None
            if rec is not None and rec.state == "active":
                end = self.core.stalls.end_on_the_clients_behalf(
                    rec.begin, rec.begin_at, "events.inferred_end"
                )
            self._end_call(stall, call_id, at, end)

    def _join(self, stall: Stall, call: ToolCall, now: float) -> None:
        """A tool call of a session whose stall is open (a parallel call): it shares the stall,
        whose chain was decided and saved once; the stall lasts until the last call returns."""
        later = stall.calls.join(call)
        self.core.stalls.by_call[call.stall_id] = stall.stall_id
        self.core.stats.inc("stalls.joined")
        if stall.decision is not None:
            self.core.sessions.set_decision(call.stall_id, stall.decision)
        if not later:
            return
        self._retime(stall)
        if not stall.offloaded and math.isfinite(stall.next_eval):
            # A retryable "no" (too short, say) is asked again now: the stall lasts longer.
            stall.retry_s, stall.next_eval = 0.0, now

    def _retime(self, stall: Stall) -> None:
        """The stall's open calls changed: its predicted return, upload plan, kept-room window and
        place in the eviction queue follow the last of them."""
        stall.predicted_s = stall.calls.returns_at - stall.begin_at
        if stall.offloaded:
            plan = self.core.planner.retime(stall.stall_id, stall.calls.timings())
            if plan is not None:
                stall.reserve_from, stall.reserve_until = plan.due_at, plan.late_at
        if stall.stall_id in self.core.eviction.demoted:
            self.core.eviction.demote(stall)

    def expire_calls(self, stall: Stall, call_ids: list[str], reason: str, *, tracked: bool = False) -> None:
        """Calls of ``stall`` whose end never came expire, each once (in the tracker too, unless it
        expired them itself: ``tracked``); the stall expires with its last open call."""
        for call_id in call_ids:
            if self.core.stalls.leave(stall, call_id) is None:
                continue
            if not tracked:
                self.core.sessions.expire(call_id, reason)
            self.core.stats.inc(f"stalls.expired.{reason}")
        if stall.calls.open:
            self._retime(stall)
            return
        self.core.stalls.pop(stall)
        self.core.planner.cancel(stall.stall_id, "expired")
        self.core.stalls.release(stall.stall_id)

    def _finish_stall(self, stall: Stall) -> None:
        self.core.stats.inc(f"stalls.final_decision.{stall.decision or 'undecided'}")
        self.core.stalls.ended[stall.stall_id] = stall
        self.core.stalls.last.put(stall.session_id, stall, hashes_nbytes(stall.hashes))
        if stall.decision is not None:
            self._set_decision(stall, stall.decision)

    def _set_decision(self, stall: Stall, decision: str) -> None:
        """Record the stall's decision for each of its calls (acks of duplicate events report it)."""
        for call_id in stall.calls.joined:
            self.core.sessions.set_decision(call_id, decision)

    def _retry_in(self, stall: Stall) -> float:
        """When to ask a retryable "no" again: at once while requests wait, else backing off."""
        base = self.core.opts.reevaluate_s
        if self.core.requests.waiting:
            stall.retry_s = base
        else:
            stall.retry_s = min(max(stall.retry_s * 2, base), max(self.core.opts.reevaluate_max_s, base))
        return stall.retry_s

    def ask_backed_off_now(self, now: float) -> None:
        """Requests started waiting: pressure may have come, ask every backed-off stall now."""
        for stall in self.core.stalls.active.values():
            if stall.retry_s > self.core.opts.reevaluate_s and math.isfinite(stall.next_eval):
                stall.retry_s = 0.0
                stall.next_eval = now

    def _evaluate(self, stall: Stall, now: float) -> None:
        """Ask the gate; on yes pin the device chain and plan the device → host copy."""
        if self.core.pool is None:
            return
        chain = self.core.offload.chain(stall.hashes)
        view = self.core.offload.view(
            chain,
            stall.predicted_s,
            max(0.0, now - stall.begin_at),
            stall.known,
            now,
            session_id=stall.session_id,
            agent_type=stall.agent_type,
            tool=stall.tool,
            at_finish=False,
            announced=False,
        )
        plan = self.core.policy.on_stall(view)
        if plan.action == "offload" and not self.core.opts.offload:
            plan = Plan("none", "disabled")
        first = stall.decision is None
        if first:
            stall.chain_at_decision = len(chain)
        if not first and plan.reason == "no_blocks":
            # The blocks were evicted while we waited for pressure or room: keep the reason we were
            # waiting for (that is why nothing was offloaded) and stop asking.
            self.core.stats.inc(f"stalls.lost_while_waiting.{stall.decision}")
            stall.next_eval = float("inf")
            return
        stall.decision = plan.reason
        if first:
            self.core.stats.inc(f"stalls.decision.{plan.reason}")
            self.core.offload.count_plan("stall", plan)
        self._set_decision(stall, plan.reason)
        if plan.action == "keep":
            self.core.holds.keep(stall.session_id, chain, now + plan.keep_s, now)
        elif plan.action == "discard" and self.core.demote_enabled:
            # Nothing is copied: the idle device blocks are the first to go (tail first).
            blocks = self.core.eviction.chain_blocks(stall, on_host_only=False, first_in_line=True)
            moved = self.core.pool.reorder(blocks, first=True)
            self.core.stats.inc("evict_order.discarded_blocks", moved)
        if plan.action != "offload":
            stall.next_eval = now + self._retry_in(stall) if plan.retry else float("inf")
            return
        stall.evict_first = plan.evict_first
        try:
            left = remaining_s(
                stall.predicted_s, max(0.0, now - stall.begin_at), self.core.gate.overdue_factor
            )
            self.core.offload.plan_offload(
                chain, stall_id=stall.stall_id, session_id=stall.session_id, returns_at=now + left
            )
        except HostPoolExhausted:
            # Room may come back (other stalls end, copies finish): ask again, as for a gate "no".
            stall.decision = "host_pool_full"
            stall.next_eval = now + self.core.opts.reevaluate_s
            self.core.stats.inc("stalls.decision.host_pool_full_at_alloc")
            return
        stall.next_eval = float("inf")
        # Host copies that already exist (an earlier turn's prefix, an early save) get pinned for
        # this stall now; copies still in flight are pinned when they commit.
        for _i, _h, _dev, slot in chain:
            if slot is not None:
                self.core.host.pin(slot, stall_owner(stall.stall_id))
        stall.offloaded = True
        h2d = self.core.transfer.estimate("h2d", len(chain) * self.core.block_bytes)
        planned = self.core.planner.begin(
            stall.stall_id,
            stall.session_id,
            stall.predicted_s,
            h2d,
            key=f"{stall.agent_type}/{stall.tool}",
            wait_s=self.core.steps.step_wait_s(),
            now=stall.begin_at,
            mode=plan.prefetch,
        )
        if stall.calls.shared:  # timed by each open call's own forecast and return ratios
            planned = self.core.planner.retime(stall.stall_id, stall.calls.timings()) or planned
        stall.reserve_from, stall.reserve_until = planned.due_at, planned.late_at
        if not first:
            self.core.stats.inc("stalls.offload_after_retry")
        if not self.core.copies.offload_pending(stall):
            self.core.eviction.demote(stall)

    def reopen_after_reset(self, now: float) -> None:
        """A prefix-cache reset dropped every host copy: a live stall decided "offload" relied on
        its copies (pinned, or planned for upload at its return). It is undecided again and asked
        at the next step, against the chain computed under the new weights; its plan and its
        (now empty) host pins go."""
        for stall in self.core.stalls.active.values():
            if not stall.offloaded or stall.ended_at is not None:
                continue
            stall.offloaded, stall.decision = False, None
            stall.retry_s, stall.next_eval = 0.0, now
            stall.reserve_from = stall.reserve_until = math.inf
            stall.reserve_blocks = None
            self.core.planner.cancel(stall.stall_id, "reset")
            self.core.host.release(stall_owner(stall.stall_id))
            self.core.stats.inc("reset.stalls_reopened")

    def tick_stall(self, stall: Stall, now: float) -> None:
        if stall.next_eval <= now and stall.ended_at is None:
            self._evaluate(stall, now)
        # A call past its own deadline expires alone while another call of the stall runs.
        overdue = stall.calls.overdue(now, self.core.stalls.expiry)
        if overdue:
            self.expire_calls(stall, [c.stall_id for c in overdue], "no_stall_end")
        # An offloaded stall is the planner's to expire while it is planned; once its plan is gone
        # (a failed or timed-out prefetch, a reset) the same deadline applies here.
        planned = stall.offloaded and self.core.planner.is_open(stall.stall_id)
        if not planned and now >= stall.calls.deadline(self.core.stalls.expiry):
            self.expire_calls(stall, list(stall.calls.open), "no_stall_end")


__all__ = ["StallLifecycle"]
