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
