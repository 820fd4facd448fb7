"""``OffloadPlanning``: stalls whose host copy a save preempted go back in a fixed order."""

from __future__ import annotations

import pytest

from tokencake.serving.kvcore.core import KVCore
from tokencake.serving.kvcore.records import Stall, stall_owner


def test_stalls_that_lost_host_slots_are_promoted_in_slot_order_whatever_the_hash_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core = KVCore(block_size=4, block_bytes=64, num_host_blocks=8)
    for i in range(8):
        core.stalls.add(Stall(f"s{i}", f"session-{i}", "worker", "search", 0.0, 10.0, (f"h{i}".encode(),)))
    promoted: list[str] = []
    monkeypatch.setattr(core.eviction, "promote", lambda stall: promoted.append(stall.stall_id))
    losers = {
        3: frozenset(stall_owner(f"s{i}") for i in (5, 1, 4, 0, 2)),
        1: frozenset([stall_owner("s7"), stall_owner("s2"), stall_owner("s6"), "job:9"]),
    }
    core.offload._after_host_preemption([3, 1], losers)
    assert promoted == ["s0", "s1", "s2", "s4", "s5", "s6", "s7"]
