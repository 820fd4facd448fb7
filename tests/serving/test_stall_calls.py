"""The rule concurrent tool calls of one session share their stall by (connector and simulator)."""

from __future__ import annotations

import math

from tokencake.serving.stall_calls import StallCalls, ToolCall


def expiry(predicted_s: float) -> float:
    return max(4 * predicted_s, 60.0)


def test_the_stall_returns_with_the_last_open_call() -> None:
    calls = StallCalls(ToolCall("a", "agent", "search", 100.0, 5.0))
    assert not calls.shared and calls.returns_at == 105.0
    assert calls.join(ToolCall("b", "agent", "fetch", 100.5, 20.0))  # later: moves the return
    assert not calls.join(ToolCall("c", "agent", "search", 101.0, 1.0))  # returns before b
    assert calls.shared and calls.joined == ["a", "b", "c"] and calls.returns_at == 120.5
    assert calls.timings() == [
        (100.0, 5.0, "agent/search"),
        (100.5, 20.0, "agent/fetch"),
        (101.0, 1.0, "agent/search"),
    ]
    b = calls.leave("b")
    assert b is not None and b.tool == "fetch" and calls.returns_at == 105.0  # back to a's
    assert calls.leave("b") is None  # each call leaves once
    assert calls.leave("a") is not None and calls.leave("c") is not None
    assert calls.open == {} and calls.returns_at == -math.inf and calls.joined == ["a", "b", "c"]


def test_a_call_past_its_own_deadline_expires_alone() -> None:
    calls = StallCalls(ToolCall("a", "agent", "search", 100.0, 5.0))  # deadline 160
    calls.join(ToolCall("b", "agent", "fetch", 100.0, 100.0))  # deadline 500
    assert calls.deadline(expiry) == 500.0
    assert calls.overdue(159.0, expiry) == []
    assert [c.stall_id for c in calls.overdue(160.0, expiry)] == ["a"]
    assert calls.overdue(500.0, expiry) == []  # all past: the stall itself expires
    calls.leave("a")
    assert calls.deadline(expiry) == 500.0 and calls.overdue(600.0, expiry) == []
