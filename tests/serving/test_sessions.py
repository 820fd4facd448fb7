from __future__ import annotations

import threading

import pytest

from tokencake.events import EventAck, StallBegin, StallEnd
from tokencake.serving.sessions import SessionTracker


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
