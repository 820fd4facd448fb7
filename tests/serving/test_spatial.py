"""The spatial score: DAG position first, then aging so nothing starves (pure, no vLLM)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokencake.events import GraphMeta, RequestMeta
from tokencake.serving.spatial import (
    SpatialScorer,
    SpatialWeights,
    admission_weights,
    demote_rank,
    reserved_sessions,
)


def meta(
    *,
    critical: bool = False,
    slack: float = 0.0,
    depth: int = 0,
    importance: float = 1.0,
    run: str = "run",
) -> RequestMeta:
    graph = GraphMeta(on_critical_path=critical, slack_s=slack, remaining_depth=depth)
    return RequestMeta(session_id=f"{run}:a", run_id=run, node="a", importance=importance, graph=graph)


def score(scorer: SpatialScorer, m: RequestMeta | None, waited: float = 0.0, pre: int = 0) -> float:
    return scorer.score(m, waited_s=waited, preemptions=pre, now=100.0)


def test_critical_path_and_less_slack_first() -> None:
    s = SpatialScorer()
    crit, near, far = meta(critical=True), meta(slack=3.0), meta(slack=40.0)
    assert score(s, crit) < score(s, near) < score(s, far)
    # More of the DAG left behind this node: later (shortest remaining first); importance > 1
    # shrinks the slack.
    assert score(s, near) < score(s, meta(slack=3.0, depth=4))
    assert score(s, meta(slack=40.0, importance=10.0)) < score(s, far)
    # Slack is capped: beyond max_slack_s all are "not urgent" alike.
    assert score(s, meta(slack=500.0)) == score(s, meta(slack=5000.0))


def test_of_two_apps_that_started_together_the_one_with_fewer_nodes_left_goes_first() -> None:
    """The contended catalog mix: Code-Writer (20 nodes deep) and Deep-Research (5) arrive together;
    a mean over apps rewards finishing the shorter one first. The order before gave the depth left
    as a credit, so every critical request of the deeper app went first."""
    long_app = meta(critical=True, depth=18, run="code-writer")
    short_app = meta(critical=True, depth=3, run="deep-research")
    for weights, first, second in (
        (SpatialWeights(), short_app, long_app),
        (admission_weights("remaining-depth-first"), long_app, short_app),
    ):
        s = SpatialScorer(weights)
        assert score(s, first) < score(s, second)
        # The depth term is bounded (10 s): an app that started 10 s earlier goes first whatever
        # its depth.
        s = SpatialScorer(weights)
        s.score(second, waited_s=0.0, preemptions=0, now=100.0)  # its app starts at 100 s
        assert s.score(second, waited_s=10.0, preemptions=0, now=110.0) < s.score(
            first, waited_s=0.0, preemptions=0, now=110.0
        )
    # Still below every non-critical request: the critical path goes first whatever is left.
    s = SpatialScorer()
    assert score(s, meta(critical=True, depth=50)) < score(s, meta(slack=0.0), pre=5)


def test_plain_requests_rank_between_and_keep_first_come_first_served() -> None:
    s = SpatialScorer()
    assert score(s, meta(critical=True)) < score(s, None) < score(s, meta(slack=40.0))
    # Same base for every plain request: the one that waited longer goes first.
    assert score(s, None, waited=2.0) < score(s, None, waited=1.0)


def test_waiting_outranks_a_newer_more_urgent_request() -> None:
    s = SpatialScorer(SpatialWeights(app_age=0.0))  # waiting alone (the app's age is another test)
    old, new = meta(slack=10.0), meta(critical=True)
    # The old one's slack and the critical path's head start, in seconds of waiting.
    head = (10.0 + s.weights.critical_s) / s.weights.aging
    assert score(s, new) < score(s, old, waited=head - 1.0)
    assert score(s, old, waited=head + 1.0) < score(s, new)


def test_the_critical_path_outranks_every_other_credit_a_request_holds_at_once() -> None:
    # Among requests of apps of the same age, a non-critical request deep in its DAG, preempted the
    # most and with its chain held on device still ranks behind a critical-path request (the
    # priority scheduler's order) until it has waited the critical path's head start longer.
    s = SpatialScorer()
    w = s.weights
    s.app_started("a", now=0.0)
    s.app_started("b", now=0.0)
    now = 50.0
    rich = meta(slack=0.5, depth=w.max_depth, run="a")
    crit = meta(critical=True, run="b")

    def key(m: RequestMeta, arrival: float, pre: int = 0, retained: bool = False) -> float:
        return s.order_key(m, arrival=arrival, preemptions=pre, now=now, retained=retained)

    assert key(crit, now) < key(rich, now, pre=w.max_preemptions, retained=True)
    # Bounded: waiting (almost) the head start longer closes the gap.
    assert key(rich, now - w.critical_s / w.aging, pre=w.max_preemptions, retained=True) < key(crit, now)


def test_the_app_that_started_first_goes_first() -> None:
    """First come first served by app: a request of an app that started a minute earlier ranks
    ahead of a new request of a younger app, even one that waited a while longer; bounded by the
    app-age cap."""
    s = SpatialScorer()
    w = s.weights
    s.app_started("old", now=0.0)
    s.app_started("young", now=60.0)
    old, young = meta(slack=5.0, run="old"), meta(slack=5.0, run="young")
    assert s.order_key(old, arrival=100.0, preemptions=0, now=100.0) < s.order_key(
        young, arrival=90.0, preemptions=0, now=100.0
    )
    s.app_started("ancient", now=-10_000.0)
    capped = s.order_key(meta(slack=5.0, run="ancient"), arrival=100.0, preemptions=0, now=100.0)
    # An app counts as started at most max_app_age_s before the request arrived.
    assert capped == pytest.approx(5.0 + w.app_age * (100.0 - w.max_app_age_s) + w.aging * 100.0)


def test_requests_of_one_app_are_first_come_first_served() -> None:
    """Keyed when queued, seconds apart: the app's age must not favour the later request (a key
    that took the app's age at queueing time made the order last come, first served)."""
    s = SpatialScorer()
    s.app_started("app", now=0.0)
    m = meta(slack=5.0, run="app")
    first = s.order_key(m, arrival=10.0, preemptions=0, now=10.0)
    second = s.order_key(m, arrival=40.0, preemptions=0, now=40.0)
    assert first < second
    # And a younger app's request queued later still goes after the older app's.
    s.app_started("young", now=20.0)
    assert first < s.order_key(meta(slack=5.0, run="young"), arrival=40.0, preemptions=0, now=40.0)


def test_preemptions_and_app_age_move_a_request_ahead() -> None:
    s = SpatialScorer()
    m = meta(slack=10.0)
    assert score(s, m, pre=1) == pytest.approx(score(s, m) - s.weights.per_preemption_s)
    assert score(s, m, pre=50) == score(s, m, pre=s.weights.max_preemptions)  # bounded
    first = SpatialScorer()
    first.app_started("early", now=0.0)
    first.app_started("late", now=90.0)
    early, late = meta(slack=5.0, run="early"), meta(slack=5.0, run="late")
    assert first.score(early, waited_s=0.0, preemptions=0, now=100.0) < first.score(
        late, waited_s=0.0, preemptions=0, now=100.0
    )


@settings(max_examples=300, deadline=None)
@given(
    critical=st.booleans(),
    slack=st.floats(0, 1e6),
    depth=st.integers(0, 10_000),
    importance=st.floats(1e-6, 1e6),
    pre=st.integers(0, 1000),
    old_critical=st.booleans(),
    old_slack=st.floats(0, 1e6),
    old_plain=st.booleans(),
    age=st.floats(0, 1e4),
    retained=st.booleans(),
    saved=st.booleans(),
)
def test_no_request_is_overtaken_longer_than_the_bound(
    critical: bool,
    slack: float,
    depth: int,
    importance: float,
    pre: int,
    old_critical: bool,
    old_slack: float,
    old_plain: bool,
    age: float,
    retained: bool,
    saved: bool,
) -> None:
    """Whatever arrives later, a request that has waited max_overtake_s more ranks first."""
    s = SpatialScorer()
    s.app_started("new", now=100.0 - age)  # the newcomer's app may be arbitrarily old
    newcomer = meta(critical=critical, slack=slack, depth=depth, importance=importance, run="new")
    waiting = None if old_plain else meta(critical=old_critical, slack=old_slack, run="old")
    bound = s.max_overtake_s()
    old_key = s.order_key(waiting, arrival=0.0, preemptions=0, now=100.0)
    new_key = s.order_key(
        newcomer, arrival=bound + 1e-6, preemptions=pre, now=100.0, retained=retained, saved=saved
    )
    assert old_key < new_key + 1e-9


def test_a_session_whose_kv_is_held_goes_first_among_equals() -> None:
    s = SpatialScorer()
    s.app_started("run", now=0.0)  # requests of one app, which started before both arrived
    m = meta(slack=5.0)
    w = s.weights
    held = s.order_key(m, arrival=10.0, preemptions=0, now=10.0, retained=True)
    other = s.order_key(m, arrival=5.0, preemptions=0, now=10.0)
    assert held < other  # 1 s of retained credit beats 5 s of waiting (100 s of it at 0.01 s/s)
    later = 5.0 + w.retained_s / w.aging + 1.0  # bounded: it waited longer than the credit is worth
    assert s.order_key(m, arrival=later, preemptions=0, now=10.0, retained=True) > other


def test_a_session_whose_chain_is_saved_on_host_goes_first_among_equals() -> None:
    s = SpatialScorer()
    s.app_started("run", now=0.0)
    m = meta(slack=5.0)
    w = s.weights
    other = s.order_key(m, arrival=5.0, preemptions=0, now=10.0)
    saved = s.order_key(m, arrival=10.0, preemptions=0, now=10.0, saved=True)
    assert saved < other  # a load instead of a prefill, and its pinned host copies go back sooner
    later = 5.0 + w.saved_s / w.aging + 1.0  # bounded like the retained credit
    assert s.order_key(m, arrival=later, preemptions=0, now=10.0, saved=True) > other
    # The credits do not add up: a chain held on device and saved on host counts once.
    both = s.order_key(m, arrival=10.0, preemptions=0, now=10.0, retained=True, saved=True)
    assert both == s.order_key(m, arrival=10.0, preemptions=0, now=10.0, retained=True)
    # Continuum's order credits only KV retained on device (its TTL pin).
    c = SpatialScorer(admission_weights("continuum"))
    assert c.order_key(m, arrival=10.0, preemptions=0, now=10.0, saved=True) == c.order_key(
        m, arrival=10.0, preemptions=0, now=10.0
    )


def test_the_order_key_sorts_as_the_scores_do_later() -> None:
    s = SpatialScorer()
    reqs = [
        (meta(slack=10.0), 0.0, 0),
        (meta(critical=True), 8.0, 0),
        (None, 3.0, 1),
        (meta(slack=2.0), 5.0, 0),
    ]
    s.app_started("x", now=0.0)
    s.app_started("y", now=4.0)
    reqs = [*reqs, (meta(slack=10.0, run="x"), 2.0, 0), (meta(slack=10.0, run="y"), 9.0, 0)]
    # Each keyed when it arrived (queued then), compared later: the keys' order is the scores'.
    keys = [s.order_key(m, arrival=a, preemptions=p, now=a) for m, a, p in reqs]
    for now in (10.0, 50.0, 500.0):
        scores = [s.score(m, waited_s=now - a, preemptions=p, now=now) for m, a, p in reqs]
        assert sorted(range(len(reqs)), key=keys.__getitem__) == sorted(
            range(len(reqs)), key=scores.__getitem__
        )


def test_weights_are_checked_and_apps_bounded() -> None:
    with pytest.raises(ValueError, match="aging"):
        SpatialWeights(aging=0.0)
    with pytest.raises(ValueError, match="plain_slack_s"):
        SpatialWeights(plain_slack_s=-1.0)
    s = SpatialScorer(max_apps=2)
    for i, run in enumerate(("a", "b", "c")):
        s.app_started(run, now=float(i))
    assert s.app_started("a", now=10.0) == 10.0  # "a" was dropped (LRU), seen anew
    # (highest base 100 − lowest −416 + 300 s of app credit) / (aging 0.01 + app age 1)
    assert SpatialScorer().max_overtake_s() == pytest.approx(816.0 / 1.01)


def _two_apps(weights: SpatialWeights, gap: float = 1.5) -> SpatialScorer:
    s = SpatialScorer(weights)
    s.app_started("old", now=0.0)
    s.app_started("young", now=gap)
    return s


def test_every_request_of_the_app_that_started_first_goes_first() -> None:
    """A fan-in app finishes with its slowest worker: the older app's fresh requests (its join, a
    worker's first turn) go before a younger app's returning ones, whose chains are saved on host
    or held on device — though the younger app's request came earlier. (Before 2026-12-05 the
    10 s credits outweighed 0.1 s per second of the apps' start gap: apps side by side.)"""

    def key(s: SpatialScorer, run: str, arrival: float, **credit: bool) -> float:
        return s.order_key(
            meta(critical=True, run=run), arrival=arrival, preemptions=1, now=arrival, **credit
        )

    s = _two_apps(SpatialWeights())
    assert key(s, "old", 40.0) < key(s, "young", 20.0, saved=True)
    assert key(s, "old", 40.0) < key(s, "young", 20.0, retained=True)
    before = _two_apps(admission_weights("apps-side-by-side"))
    assert key(before, "old", 40.0) > key(before, "young", 20.0, saved=True)
    # Bounded: a request that waited 100 × the apps' start gap longer goes first.
    assert key(s, "old", 20.0 + 160.0) > key(s, "young", 20.0)
    # Among apps that started together the credits still order: held or saved, then neither.
    t = _two_apps(SpatialWeights(), gap=0.0)
    assert key(t, "young", 20.0, retained=True) == key(t, "old", 20.0, saved=True) < key(t, "young", 19.0)


def test_an_older_apps_non_critical_request_never_outranks_a_younger_apps_critical_path() -> None:
    """Not even one with no slack left and every credit, against a critical request with none."""
    s = SpatialScorer()
    w = s.weights
    s.app_started("old", now=0.0)
    s.app_started("young", now=1000.0)
    eager = meta(slack=0.0, depth=w.max_depth, run="old")
    lazy = s.order_key(eager, arrival=1000.0, preemptions=w.max_preemptions, now=1000.0, retained=True)
    crit = s.order_key(meta(critical=True, run="young"), arrival=1000.0, preemptions=0, now=1000.0)
    assert crit < lazy


def test_continuums_order_is_first_come_first_served_with_retained_programs_first() -> None:
    s = SpatialScorer(admission_weights("continuum"))

    def key(m: RequestMeta | None, arrival: float, retained: bool = False) -> float:
        return s.order_key(m, arrival=arrival, preemptions=3, now=arrival, retained=retained)

    critical, slack, plain = meta(critical=True, depth=9), meta(slack=50.0, run="b"), None
    # DAG position, slack, preemptions and plain-ness do not matter: arrival order does.
    assert key(slack, 1.0) < key(critical, 2.0) < key(plain, 3.0)
    # A program whose KV is retained goes ahead of up to 30 s of earlier arrivals, no further.
    assert key(slack, 29.0, retained=True) < key(critical, 0.0)
    assert key(slack, 31.0, retained=True) > key(critical, 0.0)
    assert s.max_overtake_s() == pytest.approx(30.0)
    assert admission_weights(None) == admission_weights("unknown") == SpatialWeights()


def test_demote_rank_evicts_non_critical_first_then_the_latest_return() -> None:
    chains = {
        "crit-late": demote_rank(critical=True, returns_at=90.0),
        "crit-soon": demote_rank(critical=True, returns_at=5.0),
        "other-late": demote_rank(critical=False, returns_at=60.0),
        "other-soon": demote_rank(critical=False, returns_at=1.0),
    }
    evicted_first = sorted(chains, key=chains.__getitem__, reverse=True)
    assert evicted_first == ["other-late", "other-soon", "crit-late", "crit-soon"]


def test_the_reserve_takes_the_soonest_critical_returns_while_they_fit() -> None:
    holds = [("late", 30.0, 2), ("soon", 10.0, 3), ("mid", 20.0, 4)]
    assert reserved_sessions(holds, 7) == {"soon", "mid"}
    assert reserved_sessions(holds, 6) == {"soon"}  # "mid" does not fit: nothing after it either
    assert reserved_sessions(holds, 2) == frozenset() and reserved_sessions([], 10) == frozenset()


def test_requests_without_a_run_id_do_not_pool_into_one_old_app() -> None:
    """An empty ``run_id`` names no app: each such request is a new app, as a plain request is."""
    scorer = SpatialScorer()
    scorer.order_key(meta(run=""), arrival=0.0, preemptions=0, now=0.0)
    late = scorer.order_key(meta(run=""), arrival=1000.0, preemptions=0, now=1000.0)
    fresh = scorer.order_key(meta(run="x"), arrival=1000.0, preemptions=0, now=1000.0)
    assert late == fresh


def test_a_request_without_an_arrival_time_does_not_make_its_app_old() -> None:
    s = SpatialScorer()
    s.order_key(meta(critical=True, run="a"), arrival=0.0, preemptions=0, now=1000.0)
    assert s.app_started("a", now=2000.0) == 1000.0  # when it was first seen, not the epoch


def _branch(session: str, *, critical: bool = False, slack: float = 0.0, run: str = "app") -> RequestMeta:
    graph = GraphMeta(on_critical_path=critical, slack_s=slack)
    return RequestMeta(session_id=session, run_id=run, node=session, graph=graph)


def test_a_branch_that_queued_past_its_slack_is_on_the_critical_path() -> None:
    """Slack is how far a branch may fall behind the critical path: queueing longer than the app's
    critical-path sessions did spends it, and a branch that spent it all ranks as critical."""
    s = SpatialScorer()
    s.app_started("app", now=0.0)
    s.app_started("younger", now=5.0)
    side, crit = _branch("app:w0", slack=10.0), _branch("app:w1", critical=True)
    younger_crit = _branch("younger:w1", critical=True, run="younger")

    def key(m: RequestMeta) -> float:
        return s.order_key(m, arrival=30.0, preemptions=0, now=30.0)

    assert key(younger_crit) < key(side)  # on plan: the slack holds it back
    s.admitted(crit, request_id="c1", waited_s=4.0)
    s.admitted(side, request_id="s1", waited_s=12.0)  # 8 s behind: 2 s of slack left
    assert s.behind_s(side) == 8.0 and key(younger_crit) < key(side)
    s.admitted(side, request_id="s1", waited_s=13.0)  # the same request again: its last wait counts
    assert s.lag_s("app:w0") == 13.0
    s.admitted(side, request_id="s2", waited_s=2.0)  # 11 s behind: past its slack
    assert s.behind_s(side) == 11.0
    assert key(side) < key(younger_crit)  # critical now, and its app started first
    assert key(side) == key(crit)
    # Queueing alike is no lag: the critical path waited as long.
    s.admitted(crit, request_id="c2", waited_s=11.0)
    assert s.behind_s(side) == 0.0 and key(younger_crit) < key(side)


def test_with_the_slack_fixed_a_late_branch_stays_behind() -> None:
    s = SpatialScorer(admission_weights("static-slack"))
    side = _branch("app:w0", slack=10.0)
    s.admitted(side, request_id="s1", waited_s=100.0)
    crit = _branch("other:w1", critical=True, run="other")
    s.app_started("app", now=0.0)
    s.app_started("other", now=0.0)
    assert s.order_key(crit, arrival=5.0, preemptions=0, now=5.0) < s.order_key(
        side, arrival=5.0, preemptions=0, now=5.0
    )


def test_plain_requests_and_unknown_sessions_have_no_lag() -> None:
    s = SpatialScorer()
    s.admitted(None, request_id="p", waited_s=50.0)
    s.admitted(RequestMeta(session_id="x", run_id="", node="n"), request_id="q", waited_s=50.0)
    assert s.lag_s("x") == 0.0 and s.behind_s(_branch("y", slack=3.0)) == 0.0
