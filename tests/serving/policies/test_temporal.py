from __future__ import annotations

from tokencake.serving.gate import OffloadGate, TransferModel
from tokencake.serving.policies import TokenCakePolicy


def policy(**kw: object) -> TokenCakePolicy:
    return TokenCakePolicy(
        OffloadGate(TransferModel(base_s=0.0, d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9), **kw)
    )


def test_offloads_when_the_gate_says_so_with_predictive_prefetch(make_view) -> None:
    plan = policy().on_stall(make_view())
    assert (plan.action, plan.reason, plan.prefetch, plan.evict_first) == (
        "offload",
        "offload",
        "predictive",
        True,
    )


def test_a_retryable_no_is_asked_again(make_view) -> None:
    plan = policy().on_stall(make_view(gate={"device_usage": 0.1}))
    assert (plan.action, plan.reason, plan.retry) == ("none", "no_pressure", True)


def test_too_short_for_the_round_trip(make_view) -> None:
    plan = policy().on_stall(make_view(gate={"predicted_s": 0.01}))
    assert (plan.action, plan.reason) == ("none", "too_short")


def test_at_finish_only_an_announced_tool_call_is_saved(make_view) -> None:
    p = policy()
    assert p.on_finished(make_view(announced=False)).reason == "not_announced"
    assert p.on_finished(make_view(at_finish=True)).action == "offload"


def test_no_pressure_yet_saves_at_finish_into_free_host_slots_only(make_view) -> None:
    """At request_finished with no pressure yet, free host slots make the save displace nobody:
    save now rather than race the blocks' eviction later. During the stall, and when the save
    would have to reclaim other sessions' copies, "no pressure" stays a retryable no."""
    p = policy()
    calm = {"device_usage": 0.1}
    plan = p.on_finished(make_view(at_finish=True, gate=calm))
    assert (plan.action, plan.reason, plan.prefetch, plan.evict_first) == (
        "offload",
        "spare_room",
        "predictive",
        True,
    )
    assert p.on_stall(make_view(gate=calm)).reason == "no_pressure"
    reclaim_only = {**calm, "host_free_blocks": 5, "host_reclaimable_blocks": 500}
    plan = p.on_finished(make_view(at_finish=True, gate=reclaim_only))
    assert (plan.action, plan.reason, plan.retry) == ("none", "no_pressure", True)
    # Only the blocks not on host yet need free slots.
    plan = p.on_finished(make_view(at_finish=True, gate={**reclaim_only, "num_on_host": 6}))
    assert plan.reason == "spare_room"
    # Too short for the round trip: nothing to insure.
    assert p.on_finished(make_view(at_finish=True, gate={**calm, "predicted_s": 0.01})).action == "none"
