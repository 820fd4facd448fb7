from __future__ import annotations

import math

import pytest

from tokencake.serving.policies import ContinuumPolicy


def test_cold_start_ttl_is_log_of_the_benefit() -> None:
    p = ContinuumPolicy()
    assert p.ttl("A/search", reload_s=math.e**2) == pytest.approx(2.0)
    assert p.ttl("A/search", reload_s=0.5) == 0.0  # ln < 0: no pin


def test_ttl_maximises_cdf_times_benefit_minus_tau() -> None:
    p = ContinuumPolicy()
    for d in (1.0, 1.0, 1.0, 2.0, 30.0):
        p.observe_stall_end("A/search", d)
    # benefit 10 s: τ=1 → 0.6·10−1 = 5; τ=2 → 0.8·10−2 = 6; τ=30 → 10−30 < 0.
    assert p.ttl("A/search", reload_s=10.0) == 2.0
    # A cheap reload is not worth any pin.
    assert p.ttl("A/search", reload_s=0.5) == 0.0
    # Another key has its own history (none: cold start).
    assert p.ttl("B/run", reload_s=10.0) == pytest.approx(math.log(10.0))


def test_queue_delay_adds_to_the_benefit() -> None:
    p = ContinuumPolicy()
    for d in (3.0, 3.0, 3.0):
        p.observe_stall_end("A/search", d)
    assert p.ttl("A/search", reload_s=2.0) == 0.0  # 1·2 − 3 < 0
    p.observe_queue_delay(4.0)
    assert p.ttl("A/search", reload_s=2.0) == 3.0  # 1·(4 + 2) − 3 > 0


def test_keeps_with_the_ttl_less_the_time_already_spent(make_view) -> None:
    p = ContinuumPolicy()
    for d in (2.0, 2.0):
        p.observe_stall_end("A/search", d)
    plan = p.on_finished(make_view(recompute_s=10.0))
    assert (plan.action, plan.keep_s) == ("keep", 2.0)
    later = p.on_stall(make_view(recompute_s=10.0, gate={"elapsed_s": 1.5}))
    assert later.action == "keep" and later.keep_s == pytest.approx(0.5)
    assert p.on_stall(make_view(recompute_s=10.0, gate={"elapsed_s": 2.5})).reason == "ttl_zero"


def test_a_host_copy_makes_the_reload_the_cheaper_copy(make_view) -> None:
    p = ContinuumPolicy()
    p.observe_stall_end("A/search", 2.0)
    on_host = make_view(recompute_s=10.0, h2d_s=0.01, gate={"num_on_host": 10})
    assert p.on_finished(on_host).action == "none"


def test_not_announced_and_empty_sessions_are_left_alone(make_view) -> None:
    p = ContinuumPolicy()
    assert p.on_finished(make_view(announced=False)).reason == "not_announced"
    assert p.on_stall(make_view(gate={"num_blocks": 0})).reason == "no_blocks"


def test_bad_observations_are_ignored() -> None:
    p = ContinuumPolicy(window=2, max_keys=1)
    p.observe_stall_end("k", float("nan"))
    p.observe_stall_end("k", -1.0)
    p.observe_queue_delay(float("inf"))
    assert p.stats()["keys"] == 0
    p.observe_stall_end("k1", 1.0)
    p.observe_stall_end("k2", 1.0)
    assert p.stats()["keys"] == 1  # bounded
