from __future__ import annotations

import math

import pytest

from tokencake.serving.prefetch import PrefetchPlanner, kept_room, stall_expiry_s


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def planner(clock: Clock) -> PrefetchPlanner:
    return PrefetchPlanner(clock=clock, safety_margin_s=0.1)


def test_expiry_clamp() -> None:
    assert stall_expiry_s(1.0) == 60.0
    assert stall_expiry_s(100.0) == 400.0
    assert stall_expiry_s(5000.0) == 3600.0
    assert stall_expiry_s(float("nan")) == 60.0


def test_due_at_predicted_end_minus_lead(planner: PrefetchPlanner, clock: Clock) -> None:
    plan = planner.begin("st", "sess", predicted_s=4.0, h2d_s=0.4)
    assert plan.lead_s == pytest.approx(0.5)
    assert plan.due_at == pytest.approx(clock.t + 3.5)
    clock.t += 3.4
    assert planner.due() == []
    clock.t += 0.1
    assert planner.due() == ["st"]
    assert planner.due() == ["st"]  # stays due until started


def test_on_time_prefetch(planner: PrefetchPlanner, clock: Clock) -> None:
    planner.begin("st", "sess", predicted_s=4.0, h2d_s=0.4)
    clock.t += 3.5
    planner.mark_started("st")
    assert planner.due() == []
    clock.t += 0.2
    planner.mark_done("st")
    clock.t += 0.3
    planner.end("st")
    clock.t += 0.05
    assert planner.on_request("sess") == [("st", "on_time")]
    stats = planner.stats()
    assert stats["on_time"] == 1
    assert stats["started_predictive"] == 1
    assert stats["on_time_early_by_s"]["p50"] == pytest.approx(0.35)
    assert stats["open"] == 0
    assert planner.get("st").classification == "on_time"  # type: ignore[union-attr]


def test_early_end_makes_it_due_now(planner: PrefetchPlanner, clock: Clock) -> None:
    planner.begin("st", "sess", predicted_s=10.0, h2d_s=0.1)
    clock.t += 1.0
    plan = planner.end("st")
    assert plan is not None and plan.due_at == clock.t
    assert planner.due() == ["st"]
    planner.mark_started("st")
    assert planner.stats()["early_end"] == 1
    assert planner.stats()["started_after_end"] == 1
    assert planner.end("st") is None  # duplicate end changes nothing


def test_late_end_is_prefetched_at_due_time(planner: PrefetchPlanner, clock: Clock) -> None:
    planner.begin("st", "sess", predicted_s=2.0, h2d_s=0.0)
    clock.t += 5.0  # the tool overruns its forecast, no end yet: still prefetch
    assert planner.due() == ["st"]
    planner.mark_started("st")
    planner.mark_done("st")
    clock.t += 1.0
    planner.end("st")
    assert planner.stats()["late_end"] == 1
    assert planner.on_request("sess") == [("st", "on_time")]


def test_request_before_prefetch_done_is_late(planner: PrefetchPlanner, clock: Clock) -> None:
    planner.begin("a", "s1", predicted_s=5.0, h2d_s=0.5)
    planner.begin("b", "s2", predicted_s=5.0, h2d_s=0.5)
    clock.t += 4.5
    planner.mark_started("a")
    planner.end("a")
    planner.end("b")
    assert planner.on_request("s1") == [("a", "late")]  # copy in flight
    clock.t += 0.2
    planner.mark_done("a")  # finishes after the request arrived
    assert planner.stats()["late_by_s"]["p50"] == pytest.approx(0.2)
    # Due but never started: the request came first and its own load serves it (not a late copy).
    assert planner.on_request("s2") == [("b", "superseded_by_request")]
    assert planner.due() == []  # a classified stall is never prefetched afterwards
    assert planner.stats()["late"] == 1 and planner.stats()["superseded_by_request"] == 1


def test_evicted_after_prefetch_is_wasted(planner: PrefetchPlanner, clock: Clock) -> None:
    planner.begin("st", "sess", predicted_s=2.0, h2d_s=0.0)
    clock.t += 2.0
    planner.mark_started("st")
    planner.mark_done("st")
    planner.end("st")
    planner.mark_evicted("st")
    assert planner.on_request("sess") == [("st", "wasted")]
    assert planner.stats()["evicted_before_use"] == 1


def test_hit_on_device_false_marks_wasted(planner: PrefetchPlanner, clock: Clock) -> None:
    planner.begin("st", "sess", predicted_s=1.0, h2d_s=0.0)
    clock.t += 1.0
    planner.mark_started("st")
    planner.mark_done("st")
    assert planner.on_request("sess", hit_on_device=False) == [("st", "wasted")]


def test_an_upload_of_the_chain_head_only_is_not_wasted(planner: PrefetchPlanner, clock: Clock) -> None:
    # The budget had room for the head: the request hit it on device and loaded the rest.
    planner.begin("st", "sess", predicted_s=1.0, h2d_s=0.0)
    clock.t += 1.0
    planner.mark_started("st")
    planner.mark_done("st")
    assert planner.on_request("sess", hit_on_device=False, partial=True) == [("st", "head_only")]
    assert planner.stats()["head_only"] == 1 and planner.stats()["wasted"] == 0


def test_eviction_while_running_reprefetches_then_waits_for_end(
    planner: PrefetchPlanner, clock: Clock
) -> None:
    planner.begin("st", "sess", predicted_s=1.0, h2d_s=0.0)
    clock.t += 1.0
    planner.mark_started("st")
    planner.mark_done("st")
    planner.mark_evicted("st")  # the tool still runs: upload again now
    assert planner.due() == ["st"]
    assert planner.stats()["reprefetch_while_running"] == 1
    planner.mark_started("st")
    planner.mark_done("st")
    planner.mark_evicted("st")  # max_prefetches (2) used: wait for the end
    assert planner.due() == []
    clock.t += 10.0
    planner.end("st")
    assert planner.due() == ["st"]
    planner.mark_started("st")
    planner.mark_done("st")
    assert planner.on_request("sess") == [("st", "on_time")]
    plan = planner.get("st")
    assert plan is not None and plan.prefetches == 3 and plan.evictions == 2
    assert planner.stats()["reprefetch_after_eviction"] == 1
    assert planner.stats()["evicted_before_use"] == 2


def test_due_time_aims_at_a_low_quantile_of_learned_return_ratios(clock: Clock) -> None:
    planner = PrefetchPlanner(
        clock=clock, safety_margin_s=0.0, return_quantile=0.1, prior_ratio=0.5, min_samples=5
    )
    # No history: the prior (the forecast may be 2x too long).
    plan = planner.begin("p0", "s", predicted_s=4.0, h2d_s=0.5, wait_s=0.5)
    assert plan.lead_s == pytest.approx(1.0)
    assert plan.due_at == pytest.approx(clock.t + 0.5 * 4.0 - 1.0)
    planner.cancel("p0", "test")
    # Heavy-tailed returns of one key: ratios 0.4 .. 2.2 (actual / predicted).
    for i, ratio in enumerate([0.4, 0.6, 0.8, 1.0, 1.4, 1.8, 2.2]):
        t0 = clock.t
        planner.begin(f"h{i}", f"s{i}", predicted_s=2.0, h2d_s=0.0, key="a/crawl", now=t0)
        planner.end(f"h{i}", now=t0 + ratio * 2.0)
    assert planner.return_ratio("a/crawl") == pytest.approx(0.52)  # p10 of the seven ratios
    assert planner.return_ratio("other/tool") == pytest.approx(0.52)  # falls back to all stalls
    plan = planner.begin("k", "sk", predicted_s=10.0, h2d_s=0.0, key="a/crawl")
    assert plan.due_at == pytest.approx(clock.t + 5.2)
    # The key's own history wins once it has enough samples; a runaway tool is bounded.
    for i in range(5):
        t0 = clock.t
        planner.begin(f"b{i}", f"sb{i}", predicted_s=1.0, h2d_s=0.0, key="b/slow", now=t0)
        planner.end(f"b{i}", now=t0 + (1e9 if i == 0 else 3.0))
    assert planner.return_ratio("b/slow") == pytest.approx(3.0)
    assert planner.return_ratio("a/crawl") < 1.0
    assert max(planner.returns.overall) == 100.0


def test_the_late_end_of_the_likely_return_mirrors_the_due_quantile(clock: Clock) -> None:
    """``late_at``: the (1 - q) quantile of the learned ratios (the prior's inverse before any);
    only predictive plans have one (room is kept for a return between ``due_at`` and it)."""
    planner = PrefetchPlanner(
        clock=clock, safety_margin_s=0.0, return_quantile=0.1, prior_ratio=0.5, min_samples=5
    )
    plan = planner.begin("p0", "s", predicted_s=4.0, h2d_s=0.0)
    assert plan.late_at == pytest.approx(clock.t + 2.0 * 4.0)
    assert planner.begin("e0", "se", predicted_s=4.0, h2d_s=0.0, mode="at_end").late_at == math.inf
    for i, ratio in enumerate([0.4, 0.6, 0.8, 1.0, 1.4, 1.8, 2.2]):
        t0 = clock.t
        planner.begin(f"h{i}", f"s{i}", predicted_s=2.0, h2d_s=0.0, key="a/crawl", now=t0)
        planner.end(f"h{i}", now=t0 + ratio * 2.0)
    plan = planner.begin("k", "sk", predicted_s=10.0, h2d_s=0.0, key="a/crawl")
    assert plan.late_at == pytest.approx(clock.t + 10.0 * 1.96)  # p90 of the seven ratios
    assert plan.due_at < plan.late_at
    # Aimed at the forecast itself (no quantile): the window closes at the forecast.
    exact = PrefetchPlanner(clock=clock, safety_margin_s=0.0, return_quantile=None)
    assert exact.begin("x", "sx", predicted_s=3.0, h2d_s=0.0).late_at == pytest.approx(clock.t + 3.0)


def test_bad_estimates_do_not_move_the_due_time(planner: PrefetchPlanner, clock: Clock) -> None:
    plan = planner.begin("st", "s", predicted_s=4.0, h2d_s=float("nan"), wait_s=float("inf"))
    assert plan.due_at == pytest.approx(clock.t + 4.0 - 0.1)
    with pytest.raises(ValueError):
        PrefetchPlanner(return_quantile=1.5)


def test_expiry_without_end(planner: PrefetchPlanner, clock: Clock) -> None:
    planner.begin("short", "s1", predicted_s=1.0, h2d_s=0.0)  # expires after 60 s
    planner.begin("long", "s2", predicted_s=100.0, h2d_s=0.0)  # expires after 400 s
    clock.t += 59.9
    assert planner.expired() == []
    clock.t += 0.1
    assert planner.expired() == ["short"]
    clock.t += 340.0
    assert planner.expired() == ["long"]
    assert planner.stats()["expired"] == 2
    assert planner.on_request("s1") == []


def test_ended_but_never_requested(clock: Clock) -> None:
    planner = PrefetchPlanner(clock=clock, unused_after_s=30.0)
    planner.begin("p", "s1", predicted_s=1.0, h2d_s=0.0)
    planner.begin("q", "s2", predicted_s=100.0, h2d_s=0.0)
    clock.t += 1.0
    planner.mark_started("p")
    planner.mark_done("p")
    planner.end("p")
    planner.end("q")
    planner.cancel("q", "still_on_device")
    clock.t += 29.0
    assert planner.expired() == []
    clock.t += 1.0
    assert planner.expired() == ["p"]
    assert planner.get("p").classification == "wasted"  # type: ignore[union-attr]
    assert planner.stats()["cancelled.still_on_device"] == 1


def test_unused_when_never_prefetched(clock: Clock) -> None:
    planner = PrefetchPlanner(clock=clock, unused_after_s=5.0)
    planner.begin("r", "s1", predicted_s=100.0, h2d_s=0.0)
    clock.t += 1.0
    planner.end("r")  # due now, but the engine never started it (e.g. no device room)
    clock.t += 4.9
    assert planner.expired() == []
    clock.t += 0.1
    assert planner.expired() == ["r"]
    assert planner.get("r").classification == "unused"  # type: ignore[union-attr]
    assert planner.stats()["unused"] == 1


def test_waiting_request_keeps_its_stall_until_admitted(clock: Clock) -> None:
    """A queue longer than the grace must not free the copies the waiting request loads next."""
    planner = PrefetchPlanner(clock=clock, unused_after_s=5.0, expiry_max_s=600.0)
    planner.begin("r", "s1", predicted_s=2.0, h2d_s=0.0)
    planner.begin("other", "s2", predicted_s=2.0, h2d_s=0.0)
    clock.t += 2.0
    planner.end("r")
    planner.end("other")
    assert planner.on_waiting("s1") == 1
    clock.t += 60.0  # far past the grace: only the stall with no waiting request goes
    assert planner.expired() == ["other"]
    assert planner.on_request("s1") == [("r", "superseded_by_request")]  # no upload had started
    # Bounded: a request that waits longer than expiry_max_s lets its copies go.
    planner.begin("q", "s3", predicted_s=2.0, h2d_s=0.0)
    planner.on_waiting("s3")
    clock.t += 599.0
    assert planner.expired() == []
    clock.t += 1.0
    assert planner.expired() == ["q"]


def test_aborted_waiting_request_restores_the_grace(clock: Clock) -> None:
    planner = PrefetchPlanner(clock=clock, unused_after_s=5.0)
    planner.begin("r", "s1", predicted_s=2.0, h2d_s=0.0)
    clock.t += 2.0
    planner.end("r")
    planner.on_waiting("s1")
    clock.t += 30.0
    planner.on_waiting_cancelled("s1")  # the grace counts from the abort
    clock.t += 4.9
    assert planner.expired() == []
    clock.t += 0.1
    assert planner.expired() == ["r"]


def test_parallel_stalls_of_one_session(planner: PrefetchPlanner, clock: Clock) -> None:
    planner.begin("a", "s", predicted_s=1.0, h2d_s=0.0)
    planner.begin("b", "s", predicted_s=1.0, h2d_s=0.0)
    clock.t += 1.0
    for sid in planner.due():
        planner.mark_started(sid)
        planner.mark_done(sid)
    assert sorted(planner.on_request("s")) == [("a", "on_time"), ("b", "on_time")]


def test_capacity_bound(clock: Clock) -> None:
    planner = PrefetchPlanner(clock=clock, max_stalls=2)
    for i in range(3):
        planner.begin(f"s{i}", f"sess{i}", predicted_s=1.0, h2d_s=0.0)
    assert [p.stall_id for p in planner.open_stalls()] == ["s1", "s2"]
    assert planner.stats()["dropped_over_capacity"] == 1


def test_at_end_mode_is_due_only_when_the_tool_returns() -> None:
    planner = PrefetchPlanner(clock=lambda: 0.0)
    planner.begin("s", "A", 10.0, 0.1, now=0.0, mode="at_end")
    assert planner.due(now=9.9) == []
    planner.end("s", now=12.0)
    assert planner.due(now=12.0) == ["s"]
    assert planner.counts()["due_at_end"] == 1


def test_none_mode_is_never_due() -> None:
    planner = PrefetchPlanner(clock=lambda: 0.0)
    planner.begin("s", "A", 10.0, 0.1, now=0.0, mode="none")
    planner.end("s", now=1.0)
    assert planner.due(now=100.0) == []
    with pytest.raises(ValueError, match="mode must be"):
        planner.begin("t", "A", 1.0, 0.1, mode="soon")


def test_miss_reasons_name_what_kept_the_chain_off_device() -> None:
    from tokencake.serving.prefetch import PlannedStall, miss_reason

    def plan(state: str, **kw: object) -> PlannedStall:
        return PlannedStall("s", "a", 0.0, 3.0, 0.1, 2.0, 60.0, state=state, **kw)  # type: ignore[arg-type]

    assert miss_reason(plan("waiting"), room_at_arrival=False, deferred=0) == "no_room"
    assert miss_reason(None, room_at_arrival=True, deferred=0) == "not_planned"
    assert miss_reason(plan("waiting", mode="at_end"), room_at_arrival=None, deferred=0) == "not_planned"
    assert miss_reason(plan("waiting"), room_at_arrival=True, deferred=0) == "early_return"
    assert miss_reason(plan("waiting"), room_at_arrival=True, deferred=2) == "deferred"
    assert miss_reason(plan("on_device"), room_at_arrival=True, deferred=0) == "partial"
    assert miss_reason(plan("evicted", evictions=1), room_at_arrival=True, deferred=0) == "evicted"
    assert miss_reason(plan("prefetching"), room_at_arrival=True, deferred=0) == "prefetching"
    # Classified before the request came: given up (it came too late), or settled by another.
    gone = plan("done", classification="unused")
    assert miss_reason(gone, room_at_arrival=True, deferred=0) == "classified.unused"


def test_kept_room_goes_to_the_soonest_due_returns_that_fit() -> None:
    """Soonest due first; one that would overflow the cap is skipped (a later, smaller one may
    still fit); unknown (None) and zero counts keep nothing."""
    due = [
        (3.0, "late", lambda: 2),
        (1.0, "first", lambda: 5),
        (2.0, "big", lambda: 6),
        (0.5, "unknown", lambda: None),
        (0.7, "back", lambda: 0),
    ]
    assert kept_room(due, cap=8) == {"first": 5, "late": 2}
    assert kept_room(due, cap=11) == {"first": 5, "big": 6}
    assert kept_room([], cap=8) == {}


def test_a_stall_shared_by_concurrent_calls_is_due_when_the_last_of_them_is(
    planner: PrefetchPlanner, clock: Clock
) -> None:
    t = clock.t
    planner.begin("a", "s", predicted_s=4.0, h2d_s=0.4)  # lead 0.5 s: due at 3.5 s
    plan = planner.retime("a", [(t, 4.0, "k/x"), (t + 0.1, 10.0, "k/y")])
    assert plan is not None and plan.due_at == pytest.approx(t + 9.6)
    assert plan.late_at == pytest.approx(t + 10.1) and plan.expires_at == pytest.approx(t + 60.1)
    assert plan.predicted_s == pytest.approx(10.1) and plan.begin_at == t
    plan = planner.retime("a", [(t, 4.0, "k/x")])  # the long call ended first: back to the short one's
    assert plan is not None and plan.due_at == pytest.approx(t + 3.5) and plan.expires_at == t + 60.0
    clock.t += 3.5
    assert planner.due() == ["a"]
    planner.mark_started("a")
    plan = planner.retime("a", [(t, 4.0, "k/x"), (t + 1.0, 500.0, "k/y")])
    assert plan is not None and plan.due_at == pytest.approx(t + 3.5)  # the upload already started
    assert plan.expires_at == pytest.approx(t + 1.0 + 2000.0)
    planner.end("a")
    assert planner.retime("a", [(t, 4.0, "k/x")]) is None  # ended: nothing left to time
    assert planner.retime("nope", [(t, 4.0, None)]) is None
    assert planner.counts()["retimed"] == 3


def test_a_shared_stall_learns_each_calls_return_not_its_own(clock: Clock) -> None:
    planner = PrefetchPlanner(clock=clock, return_quantile=0.5, min_samples=1)
    t = clock.t
    planner.begin("a", "s", predicted_s=10.0, h2d_s=0.0, key="k/x")
    clock.t += 20.0
    planner.observe_return("k/x", t, 10.0, clock.t)  # ratio 2
    planner.observe_return("k/y", t, 40.0, clock.t)  # ratio 0.5
    planner.end("a", learn=False)
    assert planner.stats()["return_ratio_samples"] == 2
    assert planner.return_ratio("k/x") == pytest.approx(2.0)
    assert planner.return_ratio("k/y") == pytest.approx(0.5)
    planner.begin("b", "s", predicted_s=10.0, h2d_s=0.0, key="k/x")
    clock.t += 5.0
    planner.end("b")  # one call: the stall's own return (ratio 0.5)
    assert planner.stats()["return_ratio_samples"] == 3
