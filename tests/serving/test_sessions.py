from __future__ import annotations

import gc
import sys
import threading
import tracemalloc

import pytest

from tokencake.events import EventAck, StallBegin, StallEnd
from tokencake.serving.sessions import BlockUsers, ByteLRU, SessionTracker, hashes_nbytes


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def begin(stall_id: str = "st-1", session_id: str = "run:a", **kw: object) -> StallBegin:
    fields: dict[str, object] = dict(
        stall_id=stall_id, session_id=session_id, run_id="run", node="a", tool="search", ts=1.0
    )
    fields.update(kw)
    return StallBegin(**fields)  # type: ignore[arg-type]


def end(stall_id: str = "st-1", session_id: str = "run:a", **kw: object) -> StallEnd:
    fields: dict[str, object] = dict(
        stall_id=stall_id,
        session_id=session_id,
        run_id="run",
        node="a",
        tool="search",
        duration_s=2.0,
        ts=3.0,
    )
    fields.update(kw)
    return StallEnd(**fields)  # type: ignore[arg-type]


def hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


@pytest.fixture
def tracker() -> SessionTracker:
    t = SessionTracker(clock=Clock())
    t.record_request("run:a", hashes(3), num_tokens=400, request_id="req-1")
    return t


def assert_ack(ack: EventAck, status: str, reason: str | None = None) -> None:
    assert ack.status == status, ack
    assert ack.reason == reason, ack
    assert ack.ok is (status != "rejected")


def test_record_request_replaces_latest() -> None:
    t = SessionTracker()
    t.record_request("s", hashes(2), 300)
    t.record_request("s", hashes(4), 600, request_id="r2")
    blocks = t.session("s")
    assert blocks is not None
    assert (len(blocks.block_hashes), blocks.num_tokens, blocks.request_id) == (4, 600, "r2")
    assert t.forget_session("s") and t.session("s") is None


def test_begin_end_happy_path(tracker: SessionTracker) -> None:
    assert_ack(tracker.apply(begin()), "recorded")
    (rec,) = tracker.active_stalls("run:a")
    assert rec.blocks is not None and len(rec.blocks.block_hashes) == 3
    assert rec.agent_type == "a"  # agent_type defaults to the node
    assert_ack(tracker.apply(end()), "recorded")
    assert tracker.active_stalls() == []
    rec2 = tracker.stall("st-1")
    assert rec2 is not None and rec2.state == "ended" and rec2.end is not None
    kinds = [(tr.kind, tr.stall_id) for tr in tracker.drain()]
    assert kinds == [("begin", "st-1"), ("end", "st-1")]
    assert tracker.drain() == []


def test_blocks_snapshot_at_begin(tracker: SessionTracker) -> None:
    tracker.apply(begin())
    tracker.record_request("run:a", hashes(5), 700)  # a later request does not change the stall's view
    (tr,) = tracker.drain()
    assert tr.blocks is not None and len(tr.blocks.block_hashes) == 3


def test_duplicates_are_idempotent(tracker: SessionTracker) -> None:
    tracker.apply(begin())
    tracker.set_decision("st-1", "offload")
    dup = tracker.apply(begin())
    assert_ack(dup, "duplicate")
    assert dup.decision == "offload"
    tracker.apply(end())
    assert_ack(tracker.apply(end()), "duplicate")
    assert_ack(tracker.apply(begin()), "duplicate")  # a re-sent begin after the end
    assert [tr.kind for tr in tracker.drain()] == ["begin", "end"]  # duplicates queue nothing


def test_end_without_begin_is_unknown_stall(tracker: SessionTracker) -> None:
    ack = tracker.apply(end("ghost"))
    assert_ack(ack, "rejected", "unknown_stall")
    assert "ghost" in (ack.detail or "")
    assert tracker.drain() == []


def test_begin_after_its_end_is_end_before_begin(tracker: SessionTracker) -> None:
    tracker.apply(end("late"))  # reordered delivery: end first
    assert_ack(tracker.apply(begin("late")), "rejected", "end_before_begin")
    assert_ack(tracker.apply(begin("late")), "rejected", "end_before_begin")  # stable answer
    assert tracker.active_stalls() == []
    assert tracker.drain() == []


def test_stall_id_reused_by_other_session(tracker: SessionTracker) -> None:
    tracker.apply(begin("st", "run:a"))
    assert_ack(tracker.apply(begin("st", "run:b")), "rejected", "stall_conflict")
    assert_ack(tracker.apply(end("st", "run:b")), "rejected", "session_mismatch")
    assert_ack(tracker.apply(end("st", "run:a")), "recorded")
    assert_ack(tracker.apply(end("st", "run:b")), "rejected", "session_mismatch")


def test_unknown_session_and_no_blocks(tracker: SessionTracker) -> None:
    ack = tracker.apply(begin("x", "run:nobody"))
    assert_ack(ack, "recorded")
    assert ack.decision == "unknown_session"
    tracker.record_request("run:short", [], 50)  # prompt shorter than one block
    assert tracker.apply(begin("y", "run:short")).decision == "no_blocks"
    assert tracker.apply(begin("z", "run:a")).decision is None  # decided later on the engine thread
    assert_ack(tracker.apply(end("x", "run:nobody")), "recorded")


def test_unsupported_version(tracker: SessionTracker) -> None:
    assert_ack(tracker.apply(begin(v=2)), "rejected", "unsupported_version")


def test_expire_then_late_end(tracker: SessionTracker) -> None:
    tracker.apply(begin())
    rec = tracker.expire("st-1", "prefetch_expiry")
    assert rec is not None and rec.state == "expired"
    ack = tracker.apply(end())
    assert_ack(ack, "recorded")
    assert ack.decision == "expired"
    assert_ack(tracker.apply(end()), "duplicate")
    assert [tr.kind for tr in tracker.drain()] == ["begin"]  # expire() by the caller queues nothing


def test_sweep_expires_old_stalls() -> None:
    clock = Clock()
    t = SessionTracker(clock=clock, max_stall_age_s=10.0)
    t.apply(begin("old"))
    clock.t += 5
    t.apply(begin("new"))
    clock.t += 5
    assert t.sweep() == ["old"]
    trs = t.drain()
    assert [(tr.kind, tr.stall_id, tr.detail) for tr in trs][-1] == ("expired", "old", "max_stall_age")


def test_bounded_memory() -> None:
    t = SessionTracker(max_sessions=2, max_active_stalls=2, max_finished_stalls=2, max_orphan_ends=2)
    for i in range(3):
        t.record_request(f"s{i}", hashes(1), 128)
    assert t.session("s0") is None and t.session("s2") is not None
    for i in range(3):
        t.apply(begin(f"st{i}", "s2"))
    assert [r.stall_id for r in t.active_stalls()] == ["st1", "st2"]
    assert t.stall("st0") is not None and t.stall("st0").state == "expired"  # type: ignore[union-attr]
    assert t.stats()["expired.too_many_active_stalls"] == 1
    kinds = [(tr.kind, tr.stall_id) for tr in t.drain()]
    assert kinds == [("begin", "st0"), ("begin", "st1"), ("expired", "st0"), ("begin", "st2")]
    for i in range(5):
        t.apply(end(f"orphan{i}", "s2"))
    # the orphan memory only remembers the 2 latest lone ends
    assert t.apply(begin("orphan0", "s2")).status == "recorded"
    assert t.apply(begin("orphan4", "s2")).reason == "end_before_begin"
    assert t.stats()["finished_stalls"] <= 2


def test_begins_for_made_up_sessions_cannot_expire_a_real_sessions_stall() -> None:
    # A client flooding begins for sessions that never sent a request fills the cap with stalls
    # that hold nothing; those are expired first, oldest first, never the real session's.
    t = SessionTracker(max_active_stalls=4)
    t.record_request("run:a", hashes(2), 256)
    t.apply(begin("legit", "run:a"))
    for i in range(10):
        t.apply(begin(f"fake{i}", "nobody"))
    assert t.stall("legit").state == "active"  # type: ignore[union-attr]
    assert [r.stall_id for r in t.active_stalls()] == ["legit", "fake7", "fake8", "fake9"]
    assert t.stats()["expired.too_many_active_stalls"] == 7
    # Real sessions alone over the cap: the oldest goes, as before.
    for i in range(4):
        t.record_request(f"run:{i}", hashes(1), 128)
        t.apply(begin(f"real{i}", f"run:{i}"))
    assert t.stall("legit").state == "expired"  # type: ignore[union-attr]
    assert [r.stall_id for r in t.active_stalls()] == ["real0", "real1", "real2", "real3"]


def test_pending_queue_bound() -> None:
    t = SessionTracker(max_pending=2)
    for i in range(3):
        t.apply(begin(f"st{i}"))
    assert [tr.stall_id for tr in t.drain(max_items=1)] == ["st1"]
    assert t.stats()["transitions_dropped"] == 1


def test_thread_safety_under_concurrent_events() -> None:
    t = SessionTracker()
    t.record_request("run:a", hashes(2), 256)

    def worker(k: int) -> None:
        for i in range(200):
            sid = f"w{k}-{i}"
            t.apply(begin(sid))
            t.apply(begin(sid))
            t.apply(end(sid))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stats = t.stats()
    assert stats["acks.recorded"] == 1600
    assert stats["acks.duplicate"] == 800
    assert len(t.drain()) == 1600


# ------------------------------------------------------------------ memory bounded in bytes


def long_chain(tag: int, n: int) -> list[bytes]:
    """``n`` distinct 32-byte hashes (a long context: 8192 blocks = 128k tokens at 16 per block)."""
    prefix = tag.to_bytes(4, "little")
    return [prefix + i.to_bytes(28, "little") for i in range(n)]


def test_hashes_nbytes_matches_getsizeof() -> None:
    hs = tuple(long_chain(1, 100))
    assert hashes_nbytes(hs) == sys.getsizeof(hs) + 100 * sys.getsizeof(hs[0])
    assert hashes_nbytes(()) == sys.getsizeof(())


def test_long_contexts_stay_under_the_byte_budget() -> None:
    """64 sessions x 4096 blocks would keep ~19 MB of hashes; the tracker keeps at most 4 MiB."""
    budget = 4 << 20
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        t = SessionTracker(max_bytes=budget)
        for i in range(64):
            t.record_request(f"s{i}", long_chain(i, 4096), 4096 * 16)
            assert t.retained_bytes <= budget
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held - base <= budget * 1.1 + (256 << 10), f"{(held - base) / 2**20:.1f} MiB retained"
    per_session = hashes_nbytes(tuple(long_chain(0, 4096)))
    assert t.stats()["sessions"] == budget // per_session  # the most recent ones
    assert t.session("s63") is not None and t.session("s0") is None
    assert t.stats()["sessions_evicted_bytes"] == 64 - budget // per_session


def test_a_chain_longer_than_the_budget_keeps_its_head() -> None:
    t = SessionTracker(max_bytes=64 << 10)
    blocks = t.record_request("s", long_chain(1, 8192), 8192 * 16)
    assert 0 < len(blocks.block_hashes) < 8192 and blocks.nbytes <= 64 << 10
    assert list(blocks.block_hashes) == long_chain(1, len(blocks.block_hashes))
    assert t.stats()["sessions_truncated"] == 1


def test_finished_stalls_keep_no_hashes_and_shared_tuples_count_once() -> None:
    t = SessionTracker()
    t.record_request("run:a", long_chain(1, 1000), 16000)
    one = t.retained_bytes
    t.apply(begin("st-1"))  # the stall's snapshot is the session's tuple: no new bytes
    assert t.retained_bytes == one
    t.record_request("run:a", long_chain(2, 1000), 16000)  # the session moves on; the stall keeps its own
    assert t.retained_bytes == 2 * one
    t.apply(end())
    rec = t.stall("st-1")
    assert rec is not None and rec.blocks is None and rec.num_blocks == 1000
    assert t.retained_bytes == one
    assert t.forget_session("run:a") and t.retained_bytes == 0
    begin_tr, end_tr = t.drain()
    assert begin_tr.blocks is not None and len(begin_tr.blocks.block_hashes) == 1000
    assert end_tr.blocks is None


def test_active_stalls_over_the_budget_expire_oldest_first() -> None:
    per = hashes_nbytes(tuple(long_chain(0, 1000)))
    t = SessionTracker(max_bytes=int(3.5 * per))
    for i in range(3):
        t.record_request(f"s{i}", long_chain(i, 1000), 16000)
        t.apply(begin(f"st{i}", f"s{i}"))
        t.record_request(f"s{i}", long_chain(10 + i, 1000), 16000)  # session and stall differ now
    assert t.retained_bytes <= t.max_bytes
    assert t.stats()["expired.memory_budget"] >= 1
    assert t.stall("st0").state == "expired"  # type: ignore[union-attr]
    assert t.stall("st2").state == "active"  # type: ignore[union-attr]
    assert ("expired", "st0") in [(tr.kind, tr.stall_id) for tr in t.drain()]


def test_begin_stages_are_not_kept_in_records() -> None:
    t = SessionTracker()
    t.record_request("run:a", hashes(2), 256)
    t.apply(begin(stages={f"step{i}": 0.1 for i in range(500)}))
    (tr,) = t.drain()
    assert tr.event is not None and len(tr.event.stages or {}) == 500  # the engine still gets them
    rec = t.stall("st-1")
    assert rec is not None and rec.begin.stages is None and rec.agent_type == "a"


def test_sweep_forgets_idle_sessions_and_is_cheap() -> None:
    clock = Clock()
    t = SessionTracker(clock=clock, session_ttl_s=100.0, max_stall_age_s=1000.0)
    for i in range(5):
        t.record_request(f"s{i}", hashes(2), 256)
        clock.t += 10
    t.apply(begin("st", "s0"))  # a stall is a use: s0 becomes the most recent
    clock.t += 65  # s1 idle 105 s, s2 95 s ...
    assert t.sweep() == []
    assert [s for s in ("s0", "s1", "s2", "s3", "s4") if t.session(s) is not None] == ["s0", "s2", "s3", "s4"]
    assert t.stats()["sessions_idle_forgotten"] == 1
    # Cheap: a sweep looks only at what it removes, not at every active stall or session.
    for i in range(2000):
        t.apply(begin(f"young{i}", "s4"))
    seen = 0
    real = t._active

    class CountingDict(type(real)):  # type: ignore[misc]
        def items(self):  # type: ignore[no-untyped-def]
            nonlocal seen
            for kv in super().items():
                seen += 1
                yield kv

    t._active = CountingDict(real)
    clock.t += 1000 - 65
    assert t.sweep() == ["st"] and seen == 2  # the old stall, then the first young one


def test_byte_lru_bounds_count_and_bytes() -> None:
    lru: ByteLRU[str, int] = ByteLRU(max_items=3, max_bytes=100)
    for i in range(3):
        lru.put(f"k{i}", i, 30)
    assert len(lru) == 3 and lru.nbytes == 90
    lru.put("big", 9, 60)  # evicts the two oldest
    assert "k0" not in lru and "k1" not in lru and lru.get("k2") == 2 and lru.nbytes == 90
    lru.put("k2", 22, 10)  # replace: bytes follow
    assert lru.get("k2") == 22 and lru.nbytes == 70
    lru.put("huge", 0, 1000)  # a single entry over the bound stays (the newest is always kept)
    assert len(lru) == 1 and lru.nbytes == 1000 and lru.evicted == 4
    assert lru.pop("huge") == 0 and lru.nbytes == 0 and lru.pop("huge") is None


def test_byte_lru_reports_what_its_bounds_push_out() -> None:
    gone: list[tuple[str, int]] = []
    lru: ByteLRU[str, int] = ByteLRU(max_items=2, max_bytes=100, on_evict=lambda k, v: gone.append((k, v)))
    lru.put("a", 1, 10)
    lru.put("b", 2, 10)
    lru.pop("b")  # a pop is the caller's own: not reported
    lru.put("c", 3, 10)
    lru.put("d", 4, 10)
    assert gone == [("a", 1)] and list(dict(lru.items())) == ["c", "d"]


def test_block_users_name_the_other_stalls_that_hold_a_block() -> None:
    """A shared system prompt: both stalls hold its blocks; each one's own tail is its alone."""
    users = BlockUsers()
    users.add("sA", [b"sys0", b"sys1", b"a0"])
    users.add("sB", [b"sys0", b"sys1", b"b0"])
    assert users.others("sA", b"sys0") == ["sB"] and users.others("sB", b"sys1") == ["sA"]
    assert users.others("sA", b"a0") == [] and users.others("sA", b"unknown") == []
    users.remove("sB", [b"sys0", b"sys1", b"b0"])
    assert users.others("sA", b"sys0") == [] and len(users) == 3
    users.remove("sA", [b"sys0", b"sys1", b"a0"])
    users.remove("sA", [b"sys0"])  # twice: nothing left, no error
    assert len(users) == 0
