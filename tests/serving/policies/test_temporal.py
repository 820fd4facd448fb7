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


def test_no_pressure_yet_saves_an_announced_stall_at_finish_where_the_host_has_room(make_view) -> None:
    """At request_finished with no pressure yet, save now rather than race the blocks' eviction
    later, into any room a save under pressure could take: free slots, unheld copies (LRU), copies
    of stalls returning later. During the stall, and when the host has no such room, "no pressure"
    stays a retryable no."""
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
    full = {**calm, "host_free_blocks": 5, "host_reclaimable_blocks": 0, "host_preemptible_blocks": 0}
    plan = p.on_finished(make_view(at_finish=True, gate=full))
    assert (plan.action, plan.reason, plan.retry) == ("none", "no_pressure", True)
    # Unheld copies and the copies of later returns count as room, as under pressure.
    assert (
        p.on_finished(make_view(at_finish=True, gate={**full, "host_reclaimable_blocks": 500})).reason
        == "spare_room"
    )
    assert (
        p.on_finished(make_view(at_finish=True, gate={**full, "host_preemptible_blocks": 500})).reason
        == "spare_room"
    )
    # Only the blocks not on host yet need room.
    plan = p.on_finished(make_view(at_finish=True, gate={**full, "num_on_host": 6}))
    assert plan.reason == "spare_room"
    # Too short for the round trip: nothing to insure.
    assert p.on_finished(make_view(at_finish=True, gate={**calm, "predicted_s": 0.01})).action == "none"
