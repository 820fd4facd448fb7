"""``benchmarks/no_room_sim.py``: a no-room arrival is put down to the budget term that decided it."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "no_room_sim.py"
_spec = importlib.util.spec_from_file_location("no_room_sim", _PATH)
no_room_sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(no_room_sim)


def _entry(**kw: object) -> dict:
    base = {"room": False, "eligible": True, "ready": "missed", "chain": 10, "missing": 6, "free": 8}
    return {**base, "running": 1, "queued": 2, "head_blocks": 9, **kw}


def test_each_no_room_arrival_has_one_cause():
    assert no_room_sim.cause(_entry(free=5)) == "chain_exceeds_free"
    assert no_room_sim.cause(_entry(free=6, running=1)) == "running_floor"
    assert no_room_sim.cause(_entry(free=8, running=2)) == "queue_demand"


def test_summary_counts_only_eligible_arrivals():
    entries = [
        _entry(free=3),
        _entry(free=8, running=2),
        _entry(room=True, ready="prefetched"),
        _entry(eligible=False, free=0),  # a stall shorter than its lead: not counted
    ]
    got = no_room_sim.summarize(entries, device_blocks=40)
    assert got["eligible"] == 3 and got["no_room"] == 2
    assert got["ready_rate"] == 1 / 3
    assert got["no_room_causes"] == {"chain_exceeds_free": 1, "running_floor": 0, "queue_demand": 1}
