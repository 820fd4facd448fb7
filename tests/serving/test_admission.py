"""Admission control's rules (``tokencake.serving.admission``), shared by the connector and the
simulator."""

from __future__ import annotations

import pytest

from tokencake.serving.admission import (
    ADMIT,
    CRITICAL_RESERVE,
    KEPT_ROOM,
    Room,
    room_for,
    within_wait_bound,
)


def test_a_request_that_fits_releases_nothing() -> None:
    assert room_for(Room(free=5, need=5)) == (ADMIT, 0)
    assert room_for(Room(free=8, need=5, kept=3, holds=4)) == (ADMIT, 0)


def test_holds_yield_what_the_request_needs() -> None:
    assert room_for(Room(free=3, need=5, holds=4)) == (ADMIT, 5)


def test_a_request_that_fits_whatever_is_released_is_left_to_vllm() -> None:
    """vLLM's own test turns it away (as stock vLLM would); nothing is released for it."""
    assert room_for(Room(free=3, need=9, holds=4)) == (ADMIT, 0)
    assert room_for(Room(free=3, need=9, kept=2, holds=4, returning=1)) == (ADMIT, 0)
    assert room_for(Room(free=3, need=9, holds=4, reserve=1)) == (ADMIT, 0)


@pytest.mark.parametrize(
    ("room", "verdict"),
    [
        (Room(free=5, need=4, kept=2), KEPT_ROOM),  # fits, but not beside the kept room
        (Room(free=3, need=4, kept=2, holds=4), KEPT_ROOM),  # no hold released while room is kept
        (Room(free=1, need=4, kept=2, holds=1, returning=2), KEPT_ROOM),
        (Room(free=1, need=4, kept=2, holds=1), ADMIT),  # would not fit even with the room lent
    ],
)
def test_room_kept_for_returns_is_left_free(room: Room, verdict: str) -> None:
    assert room_for(room) == (verdict, 0)


def test_without_kept_room_a_returning_sessions_hold_stays() -> None:
    assert room_for(Room(free=1, need=4, holds=2, returning=2)) == (ADMIT, 0)


def test_the_critical_reserve_is_lent_to_no_one_who_may_wait() -> None:
    assert room_for(Room(free=2, need=5, holds=2, reserve=2)) == (CRITICAL_RESERVE, 0)
    assert room_for(Room(free=2, need=4, holds=2, reserve=2)) == (ADMIT, 4)  # B's hold is enough


def test_the_wait_bound_runs_from_the_first_look() -> None:
    assert within_wait_bound(None, 100.0, 10.0)  # looked at only now
    assert within_wait_bound(95.0, 100.0, 10.0)
    assert not within_wait_bound(90.0, 100.0, 10.0)
    assert not within_wait_bound(None, 100.0, 0.0)  # a zero bound holds nothing back
