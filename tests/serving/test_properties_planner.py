"""Property-based (stateful) test of ``PrefetchPlanner`` under random lifecycles and a fake clock.

The planner's counters are what ``/v1/stats`` and ``tokencake bench`` report as on-time / late /
wasted prefetches, and ``expired()`` is what releases host pins. So under any order of begin,
mark_started, mark_done, mark_evicted, end, on_request, expired, cancel and clock jumps: every
planned stall leaves the plan exactly once (one classification, or a cancellation), by the rules
of ``docs/policy.md`` §4; the counters add up; ``due()`` lists exactly the waiting plans that are
due, earliest first; and nothing raises, whatever the estimates (NaN, inf, negative).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokencake.serving.prefetch import CLASSIFICATIONS, PlannedStall, PrefetchPlanner

STALLS = [f"st-{i}" for i in range(8)]
SESSIONS = ["r:a", "r:b", "r:c"]
MAX_STALLS = 4
MAX_PREFETCHES = 2
UNUSED_AFTER_S = 60.0

#: Bad estimates (NaN, ±inf, negative) and plausible ones; the forecaster caps real ones at 300 s.
estimates = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0]) | st.floats(-1e3, 1e6)


class PlannerMachine(RuleBasedStateMachine):
    """Each ``begin`` opens an epoch; the model checks how (and that) every epoch closes."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.planner: PrefetchPlanner | None = None
        #: Every begin so far: [stall_id, outcome] with outcome None while open.
        self.epochs: list[list[str | None]] = []

    @initialize(quantile=st.sampled_from([None, 0.1, 0.5]), prior=st.sampled_from([0.5, 1.0]))
    def setup(self, quantile: float | None, prior: float) -> None:
        self.planner = PrefetchPlanner(
            clock=lambda: self.now,
            safety_margin_s=0.05,
            max_stalls=MAX_STALLS,
            max_finished=100_000,
            return_quantile=quantile,
            prior_ratio=prior,
            min_samples=2,
            max_prefetches=MAX_PREFETCHES,
            unused_after_s=UNUSED_AFTER_S,
        )

    # ---- helpers
    @property
    def p(self) -> PrefetchPlanner:
        assert self.planner is not None
        return self.planner

    def _open(self) -> dict[str, PlannedStall]:
        return {plan.stall_id: plan for plan in self.p.open_stalls()}

    def _settle(self, before: dict[str, PlannedStall], counts_before: dict[str, int]) -> dict[str, str]:
        """Close the epochs of plans that left; check the counters moved by exactly that much."""
        after = self._open()
        closed: dict[str, str] = {}
        for sid in set(before) - set(after):
            plan = self.p.get(sid)
            assert plan is not None, sid
            if plan.cancel_reason is not None:
                assert plan.classification is None and plan.state == "cancelled", plan
                outcome = "cancelled"
            else:
                assert plan.classification in CLASSIFICATIONS, plan
                outcome = plan.classification
            closed[sid] = outcome
            open_epochs = [e for e in self.epochs if e[0] == sid and e[1] is None]
            assert len(open_epochs) == 1, (sid, self.epochs)
            open_epochs[0][1] = outcome
        counts = self.p.counts()
        for cls in CLASSIFICATIONS:
            delta = counts.get(cls, 0) - counts_before.get(cls, 0)
            assert delta == sum(1 for o in closed.values() if o == cls), (cls, delta, closed)
        cancelled = sum(v for k, v in counts.items() if k.startswith("cancelled."))
        cancelled_before = sum(v for k, v in counts_before.items() if k.startswith("cancelled."))
        assert cancelled - cancelled_before == sum(1 for o in closed.values() if o == "cancelled")
        return closed

    # ---- rules
    @precondition(lambda self: self.planner is not None)
    @rule(
        stall_id=st.sampled_from(STALLS),
        session=st.sampled_from(SESSIONS),
        predicted=estimates,
        h2d=estimates,
        wait=estimates,
        key=st.sampled_from([None, "a/search", "b/test"]),
        back_s=st.floats(0, 5),
    )
    def begin(
        self,
        stall_id: str,
        session: str,
        predicted: float,
        h2d: float,
        wait: float,
        key: str | None,
        back_s: float,
    ) -> None:
        before, counts = self._open(), self.p.counts()
        if stall_id in before:
            return  # the engine plans a stall once (its id is unique while it is open)
        at = self.now - back_s
        ratio = self.p.return_ratio(key)
        plan = self.p.begin(stall_id, session, predicted, h2d, key=key, wait_s=wait, now=at)
        self.epochs.append([stall_id, None])
        assert plan.state == "waiting" and plan.begin_at == at
        assert math.isfinite(plan.due_at) and math.isfinite(plan.expires_at), plan
        # docs/policy.md §4: due = begin + max(r_q × predicted − lead, 0); bad estimates count as 0.
        pred = predicted if math.isfinite(predicted) and predicted > 0 else 0.0
        lead = sum(x for x in (h2d, wait) if math.isfinite(x) and x > 0) + 0.05
        assert plan.due_at == pytest.approx(at + max(ratio * pred - lead, 0.0), rel=1e-9, abs=1e-9)
        assert plan.expires_at == pytest.approx(at + min(max(4 * pred, 60.0), 3600.0))
        assert 0.0 <= ratio <= 100.0
        closed = self._settle({**before, stall_id: plan}, counts)
        assert stall_id not in closed
        # Over capacity the oldest open plan is given up, classified expired (its pins are released
        # at expiry by the engine).
        assert all(outcome == "expired" for outcome in closed.values()), closed
        assert len(self._open()) <= MAX_STALLS

    def _target(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(STALLS))

    @precondition(lambda self: self.planner is not None)
    @rule(data=st.data())
    def mark_started(self, data: st.DataObject) -> None:
        sid, before, counts = self._target(data), self._open(), self.p.counts()
        self.p.mark_started(sid)
        self._settle(before, counts)
        if sid in before:
            after = self.p.get(sid)
            assert after is not None
            if before[sid].state == "waiting":
                assert after.state == "prefetching" and after.prefetches == before[sid].prefetches + 1
            else:
                assert after.state == before[sid].state

    @precondition(lambda self: self.planner is not None)
    @rule(data=st.data())
    def mark_done(self, data: st.DataObject) -> None:
        sid, before, counts = self._target(data), self._open(), self.p.counts()
        self.p.mark_done(sid)
        self._settle(before, counts)
        if sid in before:
            after = self.p.get(sid)
            assert after is not None
            expected = "on_device" if before[sid].state == "prefetching" else before[sid].state
            assert after.state == expected

    @precondition(lambda self: self.planner is not None)
    @rule(data=st.data(), retry=st.booleans())
    def mark_evicted(self, data: st.DataObject, retry: bool) -> None:
        sid, before, counts = self._target(data), self._open(), self.p.counts()
        self.p.mark_evicted(sid, retry=retry)
        self._settle(before, counts)
        if sid in before:
            b, after = before[sid], self.p.get(sid)
            assert after is not None
            if b.state != "on_device":
                assert after.state == b.state
            elif retry and b.ended_at is None and b.prefetches < MAX_PREFETCHES:
                assert after.state == "waiting" and after.due_at == self.now
            else:
                assert after.state == "evicted"

    @precondition(lambda self: self.planner is not None)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        sid, before, counts = self._target(data), self._open(), self.p.counts()
        result = self.p.end(sid)
        self._settle(before, counts)
        if sid not in before or before[sid].ended_at is not None:
            assert result is None
            return
        b, after = before[sid], self.p.get(sid)
        assert result is not None and after is not None and after.ended_at == self.now
        if b.state == "evicted":
            assert after.state == "waiting" and after.due_at == self.now
        elif b.state == "waiting":
            assert after.due_at == min(b.due_at, self.now)
        else:
            assert after.state == b.state

    @precondition(lambda self: self.planner is not None)
    @rule(
        data=st.data(),
        calls=st.lists(
            st.tuples(st.floats(0, 5), estimates, st.sampled_from([None, "a/search", "b/test"])),
            min_size=1,
            max_size=3,
        ),
    )
    def retime(self, data: st.DataObject, calls: list[tuple[float, float, str | None]]) -> None:
        """Concurrent calls of one session share the plan: it is timed by the last of them."""
        sid, before, counts = self._target(data), self._open(), self.p.counts()
        timed = [(self.now - back, predicted, key) for back, predicted, key in calls]
        result = self.p.retime(sid, timed)
        assert self._settle(before, counts) == {}  # retiming closes nothing
        if sid not in before or before[sid].ended_at is not None:
            assert result is None
            return
        b, after = before[sid], self.p.get(sid)
        assert result is not None and after is not None and after.state == b.state
        preds = [p if math.isfinite(p) and p > 0 else 0.0 for _b, p, _k in timed]
        assert after.expires_at == pytest.approx(
            max(at + min(max(4 * p, 60.0), 3600.0) for (at, _p, _k), p in zip(timed, preds, strict=True))
        )
        assert after.predicted_s == pytest.approx(
            max(at + p for (at, _p, _k), p in zip(timed, preds, strict=True)) - b.begin_at
        )
        if b.state == "waiting":
            dues = [
                at + max(self.p.return_ratio(key) * p - b.lead_s, 0.0)
                for (at, _p, key), p in zip(timed, preds, strict=True)
            ]
            assert after.due_at == pytest.approx(max(dues), rel=1e-9, abs=1e-9)
            assert math.isfinite(after.due_at)
        else:
            assert after.due_at == b.due_at

    @precondition(lambda self: self.planner is not None)
    @rule(data=st.data(), reason=st.sampled_from(["prefetch_failed", "timeout", "expired"]))
    def cancel(self, data: st.DataObject, reason: str) -> None:
        sid, before, counts = self._target(data), self._open(), self.p.counts()
        self.p.cancel(sid, reason)
        closed = self._settle(before, counts)
        assert closed == ({sid: "cancelled"} if sid in before else {})

    @precondition(lambda self: self.planner is not None)
    @rule(session=st.sampled_from(SESSIONS), hit=st.sampled_from([None, True, False]))
    def on_request(self, session: str, hit: bool | None) -> None:
        before, counts = self._open(), self.p.counts()
        out = dict(self.p.on_request(session, hit_on_device=hit))
        closed = self._settle(before, counts)
        assert out == closed
        assert set(out) == {sid for sid, plan in before.items() if plan.session_id == session}
        for sid, cls in out.items():
            state = before[sid].state
            if state == "on_device" and hit is not False:
                assert cls == "on_time"
            elif state in ("on_device", "evicted"):
                assert cls == "wasted"
            elif state == "prefetching":
                assert cls == "late"
            else:
                assert cls == "superseded_by_request" and state == "waiting", (state, cls)

    @precondition(lambda self: self.planner is not None)
    @rule()
    def expire(self) -> None:
        before, counts = self._open(), self.p.counts()
        gone = self.p.expired()
        closed = self._settle(before, counts)
        assert sorted(gone) == sorted(closed)
        for sid in gone:
            b = before[sid]
            if b.ended_at is None:
                assert self.now >= b.expires_at and closed[sid] == "expired"
            else:
                assert self.now - b.ended_at >= UNUSED_AFTER_S
                assert closed[sid] == ("wasted" if b.state in ("on_device", "evicted") else "unused")
        for sid, plan in self._open().items():  # what stays is not overdue
            if plan.ended_at is None:
                assert self.now < plan.expires_at, sid
            else:
                assert self.now - plan.ended_at < UNUSED_AFTER_S, sid

    @rule(dt=st.sampled_from([0.0, 0.01, 0.5, 3.0, 30.0, 61.0, 400.0, 4000.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    # ---- invariants
    @invariant()
    def due_lists_exactly_the_waiting_plans_that_are_due(self) -> None:
        if self.planner is None:
            return
        due = self.p.due()
        open_ = self._open()
        expected = {sid for sid, p in open_.items() if p.state == "waiting" and p.due_at <= self.now}
        assert set(due) == expected and len(due) == len(expected), (due, expected)
        times = [open_[sid].due_at for sid in due]
        assert times == sorted(times)

    @invariant()
    def counters_add_up(self) -> None:
        if self.planner is None:
            return
        counts = self.p.counts()
        classified = sum(counts.get(c, 0) for c in CLASSIFICATIONS)
        cancelled = sum(v for k, v in counts.items() if k.startswith("cancelled."))
        open_ = self._open()
        assert counts.get("planned", 0) == classified + cancelled + len(open_) == len(self.epochs)
        assert counts.get("started", 0) == counts.get("started_predictive", 0) + counts.get(
            "started_after_end", 0
        )
        assert len(open_) <= MAX_STALLS
        for plan in open_.values():
            assert plan.state in ("waiting", "prefetching", "on_device", "evicted"), plan
            assert plan.classification is None and plan.cancel_reason is None
            # max_prefetches while the tool runs, plus the one the end makes due.
            assert plan.prefetches <= MAX_PREFETCHES + 1, plan
        assert self.p.stats()["open"] == len(open_)

    def teardown(self) -> None:
        """Once everything is overdue, every planned stall has left the plan exactly once."""
        if self.planner is None:
            return
        before, counts = self._open(), self.p.counts()
        self.now += 10_000.0
        self.p.expired()
        self._settle(before, counts)
        assert self._open() == {}
        assert all(outcome is not None for _sid, outcome in self.epochs), self.epochs


PlannerMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
test_planner_machine = PlannerMachine.TestCase
