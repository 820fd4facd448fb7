"""``benchmarks/unseen_sim.py``: readiness is pooled over the drawn workloads, not averaged."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "unseen_sim.py"
_spec = importlib.util.spec_from_file_location("unseen_sim", _PATH)
unseen_sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unseen_sim)


def _row(**counts: int) -> dict:
    return {"systems": {"tokencake": {"readiness": counts}}}


def test_readiness_pools_stalls_and_splits_out_the_ones_without_room():
    rows = [
        _row(eligible=10, prefetched=6, not_needed=2, no_room=2),  # both misses: no room
        _row(eligible=30, prefetched=2, not_needed=1, loading=3, no_room=10, no_room_not_needed=1),
    ]
    got = unseen_sim.readiness(rows)
    assert got["eligible"] == 40
    assert got["ready_rate"] == 14 / 40  # a mean of the two rows' rates would say 0.5
    assert got["ready_rate_with_room"] == 13 / 28
    assert got["no_room_share"] == 12 / 40


def test_no_eligible_stall_gives_no_readiness():
    assert unseen_sim.readiness([_row(eligible=0), {"systems": {}}]) is None
