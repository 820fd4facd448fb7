from __future__ import annotations

import math

import pytest

from tokencake.serving.policies import InferceptPolicy


def test_short_call_is_preserved(make_view) -> None:
    # preserve 10·0.1 = 1 < swap 0.02·80 = 1.6 < discard 1·80
    plan = InferceptPolicy().on_finished(make_view(gate={"predicted_s": 0.1}))
    assert plan.action == "keep" and plan.reason == "preserve" and plan.keep_s >= 60


def test_long_call_with_cheap_copies_is_swapped_back_at_the_end(make_view) -> None:
    plan = InferceptPolicy().on_finished(make_view(gate={"predicted_s": 30.0}))
    assert (plan.action, plan.reason, plan.prefetch) == ("offload", "swap", "at_end")


def test_cheap_recompute_without_host_room_is_discarded(make_view) -> None:
    v = make_view(recompute_s=0.001, gate={"predicted_s": 30.0, "host_free_blocks": 0})
    p = InferceptPolicy()
    assert p.wastes(v)["swap"] == math.inf
    assert p.on_finished(v).action == "discard"


def test_the_choice_at_announcement_stands_for_the_stall(make_view) -> None:
    p = InferceptPolicy()
    assert p.on_finished(make_view(gate={"predicted_s": 30.0})).reason == "swap"
    # At stall_begin the chain is on host: a fresh look would say preserve is free of copies — no.
    later = make_view(gate={"predicted_s": 30.0, "num_on_host": 10})
    assert p.on_stall(later).reason == "swap"
    # A re-ask later in the stall decides afresh.
    assert p.on_stall(make_view(gate={"predicted_s": 30.0, "elapsed_s": 1.0})).action == "offload"


def test_wastes_use_the_batch_memory(make_view) -> None:
    w = InferceptPolicy().wastes(make_view(device_blocks=100, device_free_blocks=20, recompute_s=2.0))
    assert w["discard"] == 2.0 * 80 and w["preserve"] == 10 * 5.0


def test_swaps_beyond_the_per_step_budget_preserve_or_discard_instead(make_view) -> None:
    # Each swap books 0.03 s on the copy lane; a step takes 0.05 s: the budget (1 step) takes a
    # new swap while the lane's queue is at most 0.05 s long.
    p = InferceptPolicy(budget_steps=1.0)

    def at(now: float, sid: str):
        v = make_view(session_id=sid, d2h_s=0.03, now_s=now, step_s=0.05, gate={"predicted_s": 30.0})
        return p.on_stall(v)

    # Lane queue before each: 0, then 0.03 s (both within one step), then 0.06 s (beyond it): the
    # third would wait behind the others and stall the batch, so min-waste picks among the rest
    # (discard 1 s x 80 blocks < preserve 10 blocks x 30 s).
    assert [at(10.0, s).reason for s in ("a", "b", "c")] == ["swap", "swap", "discard"]
    assert p.stats()["over_swap_budget"] == 1
    assert at(10.1, "d").reason == "swap"  # the lane drained meanwhile
    # Without a measured step time the budget does not apply.
    assert InferceptPolicy().within_budget(make_view(now_s=0.0, step_s=0.0))
    with pytest.raises(ValueError, match="budget_steps"):
        InferceptPolicy(budget_steps=0)
