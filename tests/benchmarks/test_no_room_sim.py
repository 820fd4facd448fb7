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


def test_the_probe_logs_the_device_at_a_next_turns_arrival_and_how_ready_it_was():
    """``ArrivalLogCore`` (the KV core with a probe) logs the device when a session's next request
    arrives and marks the entry once the request is accounted: here the saved chain was evicted,
    then uploaded before its request came."""
    from functools import partial

    from tokencake.serving.options import Options
    from tokencake.sim.engine import Engine, Request, Session
    from tokencake.sim.profiles import get_profile

    profile = get_profile("cpu-measured").with_(block_size=4, max_batched_tokens=16, max_num_seqs=8)
    log: list[dict] = []
    options = Options(policy="tokencake", usage_threshold=0.0, prefetch_reserve_frac=0.0)
    engine = Engine(
        profile,
        device_blocks=8,
        options=options,
        host_blocks=8,
        core_factory=partial(no_room_sim.ArrivalLogCore, log=log),
    )
    a = Session("app:a", "agent", 4, run_id="app", node="a")
    engine.submit(Request(0, a, 13, 1, arrival=0.0, next_tool=("t", 20.0), run_id="app"))
    while engine.has_work():
        engine.step()
    engine.stall_begin(a, "st1", "t", 20.0)
    engine.idle_until(engine.now)  # the stall is decided (its chain was saved at the finish)
    engine.cache.release(engine.cache.allocate(engine.cache.num_free))  # the device copies evicted
    while (wake := engine.next_wake()) is not None and wake < 20.0:
        engine.idle_until(wake)  # the prefetch falls due, its copy lands
    engine.idle_until(engine.now + 2.0)
    engine.stall_end(a, "st1", "t", 20.0)
    engine.submit(Request(1, a, 17, 1, arrival=engine.now, run_id="app"))
    while engine.has_work():
        engine.step()
    (entry,) = log
    assert entry["chain"] == 3 and entry["running"] == 0 and entry["queued"] == 0
    assert entry["room"] is True and entry["missing"] == 0
    assert entry["eligible"] is True and entry["ready"] == "prefetched"


def test_the_stored_runs_replay_from_their_packaged_compact_copies():
    assert [p.name for p in no_room_sim.RUNS] == [
        "stress-headclock-results.json.gz",
        "stress-headclock-shared-results.json.gz",
    ]
    (row,) = no_room_sim.replay(no_room_sim.RUNS[0])
    assert (row["run"], row["point"], row["device_blocks"]) == ("stress-headclock-results.json", "hetero", 40)
    assert row["eligible"] > 0 and sum(row["no_room_causes"].values()) == row["no_room"]
