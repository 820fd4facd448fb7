"""The simulated connector's spatial side (tokencake/sim/extension.py): critical inversions are
counted as the connector counts them, and the eviction side follows the admission order."""

from __future__ import annotations

from typing import Any

import pytest

from tokencake.serving.options import Options
from tokencake.sim.engine import Engine, Request, Session
from tokencake.sim.extension import KVExtension, _Arrival, _Hold, _Job
from tokencake.sim.profiles import HardwareProfile, get_profile
from tokencake.sim.run import SYSTEMS

PROFILE = get_profile("cpu-measured").with_(name="unit", block_size=4, max_batched_tokens=16, max_num_seqs=8)


def run(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def engine_with(scheduling: str = "spatial", **opts: object) -> Engine:
    ext = KVExtension(Options(policy="tokencake", offload=False, **opts), host_blocks=8)  # type: ignore[arg-type]
    return Engine(PROFILE, device_blocks=4, extension=ext, scheduling=scheduling)


def finish_critical(engine: Engine) -> Session:
    """A critical-path request that announced a tool call finished: its 2 blocks idle, watched."""
    crit = Session("c", "agent", 4)
    engine.submit(Request(0, crit, prompt_tokens=8, output_tokens=1, arrival=0.0, next_tool=("t", 5.0)))
    run(engine)
    assert len(engine.cache.match(crit.keys(2))) == 2
    return crit


def counters(engine: Engine) -> dict[str, int]:
    assert engine.ext is not None
    return engine.ext.stats


def test_a_non_critical_admission_that_evicts_a_critical_chain_is_an_unsaved_inversion() -> None:
    engine = engine_with()
    crit = finish_critical(engine)
    other = Request(
        1, Session("o", "agent", 4), prompt_tokens=13, output_tokens=1, arrival=engine.now, priority=5
    )
    engine.submit(other)
    run(engine)  # needs all 4 blocks: the critical chain goes, and no host copy of it exists
    assert engine.cache.match(crit.keys(2)) == []
    c = counters(engine)
    assert c["spatial.critical_inversions"] == 1 and c["spatial.critical_blocks_evicted"] == 2
    assert c["spatial.critical_inversions_unsaved"] == 1
    assert c["spatial.critical_blocks_evicted_unsaved"] == 2


def test_blocks_safe_on_host_and_critical_admissions_are_not_unsaved_inversions() -> None:
    engine = engine_with()
    crit = finish_critical(engine)
    assert engine.ext is not None
    for key in crit.keys(2):
        (slot,) = engine.ext.host.allocate(1, "test")
        engine.ext.host.commit(key, slot)
    other = Request(
        1, Session("o", "agent", 4), prompt_tokens=13, output_tokens=1, arrival=engine.now, priority=5
    )
    engine.submit(other)
    run(engine)
    c = counters(engine)
    assert c["spatial.critical_inversions"] == 1 and c["spatial.critical_inversions_unsaved"] == 0
    # Another critical request evicting a critical chain is no inversion.
    engine = engine_with()
    finish_critical(engine)
    engine.submit(Request(1, Session("d", "agent", 4), prompt_tokens=13, output_tokens=1, arrival=engine.now))
    run(engine)
    assert counters(engine)["spatial.critical_inversions"] == 0


def test_the_eviction_side_goes_with_the_spatial_admission_order() -> None:
    assert engine_with("spatial").ext.critical_last  # type: ignore[union-attr]
    assert not engine_with("priority").ext.critical_last  # type: ignore[union-attr]
    assert not engine_with("spatial", critical_last=False).ext.critical_last  # type: ignore[union-attr]
    assert SYSTEMS["spatial-order"].options == {"critical_last": False}
    assert SYSTEMS["reserve-off"].engine_scheduling() == "spatial"
    assert SYSTEMS["spare-late"].options == {"critical_spare_late": True}
    assert SYSTEMS["spare-late"].engine_scheduling() == "spatial"


def _spare_scenario(scheduling: str) -> tuple[Engine, Session, Session]:
    """A critical-path session away on a tool call (its idle chain older in the free queue), a
    non-critical session's idle chain, then a non-critical request that evicts one cached block."""
    ext = KVExtension(Options(policy="tokencake", offload=False), host_blocks=8)
    engine = Engine(PROFILE, device_blocks=6, extension=ext, scheduling=scheduling)
    crit, other = Session("c", "agent", 4), Session("o", "agent", 4)
    engine.submit(Request(0, crit, prompt_tokens=8, output_tokens=1, arrival=0.0, next_tool=("t", 5.0)))
    run(engine)
    ext.stall_begin(crit, "sc", "t", 5.0)
    engine.submit(Request(1, other, 8, 1, arrival=engine.now, priority=5, next_tool=("t", 5.0)))
    run(engine)
    engine.submit(Request(2, Session("p", "agent", 4), 12, 1, arrival=engine.now, priority=5))
    run(engine)
    return engine, crit, other


def test_a_non_critical_admission_evicts_other_blocks_before_a_critical_chain_not_on_host() -> None:
    engine, crit, other = _spare_scenario("spatial")
    assert len(engine.cache.match(crit.keys(2))) == 2 and len(engine.cache.match(other.keys(2))) == 1
    c = counters(engine)
    assert c["spatial.critical_spared_blocks"] == 2 and c["spatial.critical_inversions"] == 0
    # vLLM's LRU order (no spatial scheduler): the critical chain's tail goes.
    engine, crit, other = _spare_scenario("priority")
    assert len(engine.cache.match(crit.keys(2))) == 1
    assert counters(engine)["spatial.critical_inversions_unsaved"] == 1


def _reserve_scenario(**opts: object) -> tuple[Engine, Session]:
    """A critical-path session away on a tool call (its 2-block chain idle), then two
    non-critical requests (5 s of slack): the first runs, the second needs 3 of the 4 other
    free blocks' worth — the window holds the critical chain until the first one finishes."""
    ext = KVExtension(Options(policy="tokencake", offload=False, **opts), host_blocks=8)  # type: ignore[arg-type]
    engine = Engine(PROFILE, device_blocks=6, extension=ext, scheduling="spatial")
    crit = Session("c", "agent", 4)
    engine.submit(Request(0, crit, prompt_tokens=8, output_tokens=1, arrival=0.0, next_tool=("t", 5.0)))
    run(engine)
    ext.stall_begin(crit, "sc", "t", 5.0)
    engine.submit(Request(1, Session("a", "agent", 4), 7, 3, arrival=engine.now, priority=5))
    engine.submit(Request(2, Session("b", "agent", 4), 9, 1, arrival=engine.now, priority=5))
    run(engine)
    return engine, crit


def test_a_non_critical_admission_waits_for_the_critical_reserve_while_requests_run() -> None:
    engine, crit = _reserve_scenario()
    c = counters(engine)
    assert c["spatial.critical_reserve_waited_requests"] == 1 and c["spatial.critical_reserve_waits"] >= 1
    assert c["spatial.critical_inversions"] == 0
    assert len(engine.cache.match(crit.keys(2))) == 2
    # Without the reserve it is admitted at once and takes the critical chain.
    engine, crit = _reserve_scenario(critical_reserve_frac=0.0)
    c = counters(engine)
    assert c["spatial.critical_reserve_waits"] == 0 and c["spatial.critical_inversions"] == 1
    assert c["spatial.critical_inversions_late"] == 0  # it had slack left: the reserve could act
    # With no slack it could not have waited: the same inversion is a late one.
    engine, crit = _reserve_scenario(critical_reserve_wait_s=0.0)
    c = counters(engine)
    assert c["spatial.critical_inversions"] == 1 and c["spatial.critical_inversions_late"] == 1


def test_readiness_is_judged_when_the_next_request_arrives() -> None:
    """As the connector: a chain still on device when the session's next request arrives was
    ready for it, even if a request admitted ahead of it evicts the chain while it queues."""
    engine = engine_with("fcfs")
    assert engine.ext is not None
    a = Session("a", "agent", 4)
    engine.submit(Request(0, a, prompt_tokens=8, output_tokens=1, arrival=0.0, next_tool=("t", 5.0)))
    run(engine)
    engine.ext.stall_begin(a, "st1", "t", 5.0)
    engine.idle_until(engine.now + 5.0)
    engine.ext.stall_end("st1", 5.0)
    # A request that needs the whole device arrives first; the session's next turn right after.
    engine.submit(Request(1, Session("b", "agent", 4), prompt_tokens=13, output_tokens=1, arrival=engine.now))
    engine.submit(Request(2, a, prompt_tokens=12, output_tokens=1, arrival=engine.now))
    run(engine)
    c = counters(engine)
    assert c["next_turn.prefix_tokens_recomputed"] == 8  # evicted while it queued ...
    assert c["readiness.eligible"] == 1
    assert c["readiness.not_needed"] == 1 and c["readiness.missed"] == 0  # ... but ready at arrival
    assert c["readiness.no_room"] == 0  # a chain whole on device needs no room (as the connector)


def test_a_request_that_needs_the_lent_reserve_waits_and_the_next_one_is_admitted() -> None:
    """As the connector: a non-critical request that would fit only if the critical reserve were
    lent waits a step and the engine looks at the next request, instead of stopping admission."""
    ext = KVExtension(Options(policy="tokencake", offload=False), host_blocks=8)
    engine = Engine(PROFILE, device_blocks=8, extension=ext, scheduling="spatial")
    held = engine.cache.allocate(2)  # a critical session's chain held on device (one ref each)
    engine.cache.allocate(3)  # blocks in use: 3 free, and the big request's first chunk needs 4
    ext._holds["c"] = _Hold("c", held, until=60.0, since=0.0, rank=1.0, kind="hold", critical=True)
    big = Request(1, Session("x", "agent", 4), 25, 1, arrival=0.0, priority=5, run_id="app1")
    small = Request(2, Session("y", "agent", 4), 3, 1, arrival=0.0, priority=5, run_id="app2")
    engine.submit(big)
    engine.submit(small)
    engine.step()
    assert big.admitted_at is None and small.admitted_at is not None
    assert counters(engine)["spatial.reserve_denials"] >= 1


def test_a_plain_request_takes_the_reserve_and_held_chains_yield_to_running_requests() -> None:
    """As the connector: a plain request (no run) is not held back by the critical reserve; and a
    running request that finds no free block gets a held chain's blocks instead of a preemption
    (vLLM's ``has_pending_block_frees``), with no admission in that step."""
    ext = KVExtension(Options(policy="tokencake", offload=False), host_blocks=8)
    engine = Engine(PROFILE, device_blocks=8, extension=ext, scheduling="spatial")
    held = engine.cache.allocate(2)
    engine.cache.allocate(3)
    ext._holds["c"] = _Hold("c", held, until=60.0, since=0.0, rank=1.0, kind="hold", critical=True)
    plain = Request(1, Session("x", "agent", 4), 25, 1, arrival=0.0, priority=5)
    engine.submit(plain)
    engine.step()
    assert plain.admitted_at is not None and not ext._holds
    assert counters(engine).get("spatial.reserve_denials", 0) == 0

    ext = KVExtension(Options(policy="tokencake", offload=False), host_blocks=8)
    engine = Engine(PROFILE, device_blocks=8, extension=ext, scheduling="spatial")
    held = engine.cache.allocate(2)
    ext._holds["c"] = _Hold("c", held, until=60.0, since=0.0, rank=1.0, kind="hold", critical=True)
    run = Request(2, Session("r", "agent", 4), 4, 8, arrival=0.0, priority=5, run_id="app1")
    engine.submit(run)
    engine.step()  # admitted: its prompt's block
    engine.cache.allocate(engine.cache.num_free)  # nothing free for its next block
    late = Request(3, Session("w", "agent", 4), 3, 1, arrival=0.0, priority=5, run_id="app2")
    engine.submit(late)
    for _ in range(6):  # its second block comes due at its first decode step
        engine.step()
    assert engine.preemptions == 0 and not ext._holds
    assert counters(engine)["hold.yielded_to_running"] == 1


def test_with_the_arrival_clock_slack_is_counted_from_arrival() -> None:
    """``critical_reserve_wait_from = "arrival"`` (the rule before the head clock), as the
    connector: a request that queued past its slack could not have waited (its inversions are
    late), however recently it reached the head of the queue."""
    engine = engine_with(critical_reserve_wait_from="arrival")
    assert engine.ext is not None
    engine.running.append(Request(9, Session("r", "agent", 4), 4, 1, arrival=0.0))  # requests run
    req = Request(1, Session("o", "agent", 4), prompt_tokens=8, output_tokens=1, arrival=0.0, priority=5)
    engine.idle_until(6.0)
    req.seen_at = 5.9
    assert not engine.ext._within_slack(req)
    req.arrival = 2.0
    assert engine.ext._within_slack(req)


def test_slack_is_counted_from_the_first_look_by_default() -> None:
    """``critical_reserve_wait_from = "head"`` (the default): the queueing before the engine
    first looked at the request does not spend its slack; the wait at the head does (the
    connector's ``_reserve_waited``)."""
    engine = engine_with()
    assert engine.ext is not None
    engine.running.append(Request(9, Session("r", "agent", 4), 4, 1, arrival=0.0))  # requests run
    req = Request(1, Session("o", "agent", 4), prompt_tokens=8, output_tokens=1, arrival=0.0, priority=5)
    engine.idle_until(6.0)
    req.seen_at = 5.9
    assert engine.ext._within_slack(req)
    req.seen_at = 0.5
    assert not engine.ext._within_slack(req)


def test_waiting_for_the_sessions_prefetch_is_bounded_from_the_copys_issue() -> None:
    """As the connector: a request waits for its session's prefetch in flight only until
    ``prefetch_wait_s`` after the copy was issued, however recently the request came."""
    engine = engine_with()
    ext = engine.ext
    assert ext is not None
    session = Session("a", "agent", 4)
    ext._loading_sessions["a"] = _Job("prefetch", [], [], [], [], "job:1", issued_at=0.0)
    req = Request(1, session, prompt_tokens=8, output_tokens=1, arrival=0.0)
    engine.idle_until(ext.opts.prefetch_wait_s + 1.0)
    req.seen_at = engine.now
    assert ext.host_match(req, 0, 1) is not None  # a copy this slow is not worth waiting for
    ext._loading_sessions["a"].issued_at = engine.now
    assert ext.host_match(req, 0, 1) is None  # a fresh one is


def test_a_prefetch_does_not_queue_behind_a_save_on_a_gpu() -> None:
    """As the connector's copy lanes (measured on an H200: D2H and H2D run at once): on a GPU
    profile a prefetch issued while a save is copying starts at once, and saves queue behind
    saves."""
    gpu = get_profile("h200-llama3-8b")
    ext = KVExtension(Options(policy="tokencake"), host_blocks=64)
    Engine(gpu, device_blocks=64, extension=ext)
    save = ext._new_job("offload", [], [], list(range(32)), list(range(32)))
    prefetch = ext._new_job("prefetch", [], [], list(range(32, 40)), list(range(32, 40)))
    second_save = ext._new_job("offload", [], [], list(range(40, 44)), list(range(40, 44)))
    assert prefetch.done_at == ext.now + gpu.copy_s("h2d", 8)
    assert save.done_at == ext.now + gpu.copy_s("d2h", 32)
    assert second_save.done_at == save.done_at + gpu.copy_s("d2h", 4)


def test_a_finished_request_leaves_no_arrival_record() -> None:
    engine = engine_with()
    ext = engine.ext
    assert ext is not None
    session = Session("a", "agent", 4)
    req = Request(1, session, prompt_tokens=8, output_tokens=1, arrival=0.0)
    ext._arrivals[req.rid] = _Arrival(room=True, loading=False, device_blocks=0, missed_why="")
    engine.submit(req)
    run(engine)
    assert req.rid not in ext._arrivals


def _saved_stall(profile: HardwareProfile = PROFILE, **opts: Any) -> tuple[Engine, KVExtension, Session]:
    """An 8-block device under pressure; session ``a``'s 3-block chain saved on host, its 20 s
    tool running."""
    options = Options(policy="tokencake", usage_threshold=0.0, prefetch_reserve_frac=0.0, **opts)
    ext = KVExtension(options, host_blocks=8)
    engine = Engine(profile, device_blocks=8, extension=ext, scheduling="fcfs")
    a = Session("a", "agent", 4)
    engine.submit(Request(0, a, prompt_tokens=13, output_tokens=1, arrival=0.0, next_tool=("t", 20.0)))
    run(engine)
    ext.stall_begin(a, "st1", "t", 20.0)
    engine.idle_until(engine.now + 0.5)
    return engine, ext, a


def test_a_partial_prefetch_is_topped_up_once_room_frees() -> None:
    """As the connector: an upload the budget cut to the chain's head brings the rest once the
    queue's demand leaves room, while the tool still runs (not only at its end)."""
    engine, ext, a = _saved_stall()
    keys = a.keys(3)
    assert all(ext.host.lookup(k) is not None for k in keys)  # saved
    engine.cache.release(engine.cache.allocate(engine.cache.num_free))  # ... and evicted
    assert not any(k in engine.cache.by_key for k in keys)
    engine._wb = 6  # queued requests need 6 of the 8 free blocks: room for the head only
    engine.idle_until(engine.now + 15.0)  # past the due time, the tool still runs
    engine.idle_until(engine.now + 0.5)  # the head's copy lands
    assert [k in engine.cache.by_key for k in keys] == [True, True, False]
    assert counters(engine)["prefetch.partial"] == 1
    assert counters(engine)["prefetch.evicted_before_use"] == 0  # not mistaken for an eviction
    engine._wb = 0  # the queue was admitted
    engine.idle_until(engine.now + 0.1)
    engine.idle_until(engine.now + 0.5)
    assert all(k in engine.cache.by_key for k in keys)
    assert counters(engine)["prefetch.topups"] == 1
    assert len(ext._holds["a"].blocks) == 3


def test_no_room_keeps_a_block_free_per_running_request_as_the_budget_does() -> None:
    """As the connector: the readiness ``no_room`` test and the prefetch budget share one rule
    (``_keep_free``), the running requests' one block each included."""
    engine, ext, a = _saved_stall()
    engine.cache.release(engine.cache.allocate(engine.cache.num_free))  # saved, then evicted
    nxt = Request(1, a, prompt_tokens=17, output_tokens=1, arrival=engine.now)
    free = engine.cache.num_free
    engine.running.extend([nxt] * (free - 2))  # two blocks short of the three-block chain
    assert ext._keep_free() == free - 2
    assert ext._room_for_chain(nxt) is False
    engine.running[:] = [nxt] * (free - 3)
    assert ext._room_for_chain(nxt) is True
    engine.running.clear()


def test_the_arrival_log_records_the_device_at_each_next_turn() -> None:
    """``arrival_log`` (opt-in) takes the device's state when the request arrives and marks the
    entry eligible once the request is accounted (benchmarks/no_room_sim.py reads it)."""
    engine, ext, a = _saved_stall()
    ext.arrival_log = []
    engine.cache.release(engine.cache.allocate(engine.cache.num_free))  # the chain evicted
    engine.idle_until(engine.now + 20.0)
    ext.stall_end("st1", 20.0)
    engine.submit(Request(1, a, prompt_tokens=17, output_tokens=1, arrival=engine.now))
    run(engine)
    (entry,) = ext.arrival_log
    assert entry["chain"] == 3 and entry["running"] == 0 and entry["queued"] == 0
    assert entry["eligible"] is True and entry["ready"] == "prefetched"  # uploaded before it came
    assert entry["room"] is True and entry["missing"] == 0


def test_return_reserve_is_auto_by_where_copies_run() -> None:
    """As the connector: ``auto`` keeps room ahead of returns where copies run beside the
    forward (the GPU profiles) and not where they share its cores (the CPU ones)."""
    gpu = get_profile("h200-llama3-8b")
    assert _saved_stall(gpu.with_(block_size=4))[1]._reserves_returns
    assert not _saved_stall()[1]._reserves_returns
    assert _saved_stall(return_reserve="on")[1]._reserves_returns


def test_a_due_return_is_uploaded_ahead_of_the_queue_and_its_room_kept() -> None:
    """As the connector: with kept room the due chain comes back whole although the queue wants
    the blocks (without it, only the head: ``test_a_partial_prefetch_is_topped_up...``), and an
    agent request's first admission that would take the room waits; a plain one does not."""
    engine, ext, a = _saved_stall(return_reserve="on")
    keys = a.keys(3)
    engine.cache.release(engine.cache.allocate(engine.cache.num_free))  # saved, then evicted
    engine._wb = 6  # queued requests need 6 of the 8 free blocks
    engine.running.append(Request(9, Session("r", "agent", 4), prompt_tokens=4, output_tokens=8, arrival=0.0))
    engine.idle_until(engine.now + 15.0)  # past the due time, the tool still runs
    assert ext._returning == {"a": 3}
    engine.idle_until(engine.now + 0.5)
    assert all(k in engine.cache.by_key for k in keys) and counters(engine)["prefetch.partial"] == 0
    free = engine.cache.num_free
    agent = Request(2, Session("w", "agent", 4), prompt_tokens=8, output_tokens=1, arrival=0.0, run_id="app")
    plain = Request(3, Session("p", "agent", 4), prompt_tokens=8, output_tokens=1, arrival=0.0)
    assert ext.make_room(agent, free - 2) is False  # the chain is back: nothing missing
    ext._returning = {"a": 3}  # as before the upload: 3 blocks kept
    assert ext.make_room(agent, free - 2) is True  # it would take kept room
    assert ext.make_room(agent, free - 3) is False
    assert ext.make_room(plain, free - 2) is False
    own = Request(4, a, prompt_tokens=17, output_tokens=1, arrival=0.0, run_id="app")
    assert ext.make_room(own, free) is False
    assert counters(engine)["return_reserve.denials"] == 1
    engine.running.clear()
    assert ext.make_room(agent, free - 2) is False  # nothing runs: never idle the engine


def test_parallel_tool_calls_of_a_session_share_its_stall() -> None:
    """As the connector: a tool call that begins while its session's stall is open joins it: the
    chain is saved once, its upload is due for the last call's return, the stall stays open
    until every call ended, each call teaches its own tool's forecast, and the next request is
    accounted once."""
    engine, ext, a = _saved_stall()  # call st1: tool t, 20 s
    ext.stall_begin(a, "st2", "u", 40.0)
    stall = ext._session_stall["a"]
    assert stall.stall_id == "st1" and list(ext._stalls) == ["st1"]
    assert list(ext._call_stall) == ["st1", "st2"]
    assert counters(engine)["stalls"] == 1 and counters(engine)["stalls.joined"] == 1
    assert len(ext.host.owned_by("st1")) == 3 and ext.host.owned_by("st2") == []
    plan = ext.planner.get("st1")
    assert plan is not None and ext.planner.get("st2") is None
    assert plan.due_at == pytest.approx(engine.now + 0.5 * 40.0 - plan.lead_s)  # the prior ratio × st2's
    engine.cache.release(engine.cache.allocate(engine.cache.num_free))  # saved, then evicted
    engine.idle_until(engine.now + 15.0)  # past st1's due time (10 s), before st2's (20 s)
    assert ext.planner.get("st1").state == "waiting"  # type: ignore[union-attr]
    engine.idle_until(engine.now + 4.0)
    ext.stall_end("st1", 19.5)
    assert ext._session_stall["a"] is stall and stall.ended_at is None
    assert ext.forecaster.key_stats("agent", "t")["samples"] == 1  # type: ignore[index]
    assert ext.forecaster.key_stats("agent", "u") is None
    engine.idle_until(engine.now + 21.0)
    ext.stall_end("st2", 40.0)
    assert "a" not in ext._session_stall and ext._call_stall == {} and ext._last_stall["a"] is stall
    assert ext.forecaster.key_stats("agent", "u")["samples"] == 1  # type: ignore[index]
    assert ext.planner.stats()["return_ratio_samples"] == 2
    engine.submit(Request(1, a, prompt_tokens=17, output_tokens=1, arrival=engine.now))
    run(engine)
    c = counters(engine)
    assert c["next_turn.requests"] == 1 and c["readiness.eligible"] == 1 and c["readiness.prefetched"] == 1
    assert ext.planner.counts()["on_time"] == 1 and ext.planner.counts()["planned"] == 1
    assert ext.host.owned_by("st1") == [] and ext._stalls == {}
