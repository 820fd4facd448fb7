"""The spatial scheduler's waiting queue, on vLLM's own ``Request`` objects and queue interface.

Also the drift test of the two internals it relies on (``Scheduler.waiting`` being a
``RequestQueue`` and that interface): ``check`` must pass on the supported vLLM.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.core.sched.request_queue import FCFSRequestQueue, PriorityRequestQueue, RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from tokencake.events import META_KEY
from tokencake.serving.spatial import SpatialScorer, SpatialWeights, admission_weights
from tokencake.serving.vllm import scheduler as spatial
from tokencake.serving.vllm.scheduler import ScoredRequestQueue, SpatialScheduler


def req(
    rid: str,
    arrival: float,
    *,
    critical: bool = False,
    slack: float = 0.0,
    plain: bool = False,
    session: str | None = None,
) -> Request:
    extra: dict[str, Any] = {}
    if not plain:
        graph = {"on_critical_path": critical, "slack_s": slack}
        meta = {"session_id": session or f"run:{rid}", "run_id": "run", "node": rid, "graph": graph}
        extra = {"kv_transfer_params": {META_KEY: meta}}
    params = SamplingParams(max_tokens=4, extra_args=extra)
    return Request(rid, [1, 2, 3], params, None, arrival_time=arrival, priority=0)


def vllm_scheduler(side: Any) -> Any:
    """A stand-in for vLLM's ``Scheduler`` with the attributes ``check`` looks for, whose
    connector's scheduler side is ``side``."""
    from types import SimpleNamespace

    return SimpleNamespace(
        connector=SimpleNamespace(sched=side),
        waiting=FCFSRequestQueue(),
        running=[],
        kv_cache_manager=SimpleNamespace(get_block_ids=lambda request_id: ([],)),
        max_num_scheduled_tokens=2048,
        num_lookahead_tokens=0,
        max_model_len=4096,
        block_size=16,
    )


def drain(queue: RequestQueue) -> list[str]:
    out = []
    while queue:
        out.append(queue.pop_request().request_id)
    return out


def test_the_internals_it_needs_are_there(monkeypatch: pytest.MonkeyPatch) -> None:
    assert spatial.check() is None
    assert issubclass(SpatialScheduler, Scheduler)
    assert isinstance(ScoredRequestQueue(), RequestQueue)
    sched = vllm_scheduler(None)
    assert spatial.check(sched) is None
    del sched.max_num_scheduled_tokens
    assert spatial.check(sched) == "vLLM's Scheduler lost max_num_scheduled_tokens"
    monkeypatch.delattr(Scheduler, "_handle_blocked_waiting_request")
    assert spatial.check() == "vLLM's Scheduler lost _handle_blocked_waiting_request"


def test_vllms_admission_loop_still_asks_the_hooks_admission_control_relies_on() -> None:
    """Admission control needs vLLM's waiting loop to call ``_handle_blocked_waiting_request``
    for every request it peeks and to skip (not stop at) one it answers False for, and its
    running loop to ask ``has_pending_block_frees`` before it preempts."""
    import inspect
    import re

    src = inspect.getsource(Scheduler.schedule)
    assert re.search(
        r"ready_to_schedule = self\._handle_blocked_waiting_request\(request\)\s*"
        r"if not ready_to_schedule:\s*skip_request\(request_queue\)\s*continue",
        src,
    )
    assert "self.connector.has_pending_block_frees()" in src
    hook = inspect.signature(Scheduler._handle_blocked_waiting_request)
    assert list(hook.parameters) == ["self", "request"]


def test_a_prefix_cache_reset_gives_the_policys_device_holds_back_first() -> None:
    """vLLM resets its block pool before it calls the connector, and that reset refuses while a
    block is in use: the scheduler has the connector release its holds before, when the reset
    can succeed (it preempts the running requests, or none run)."""
    import inspect
    from types import SimpleNamespace

    params = list(inspect.signature(Scheduler.reset_prefix_cache).parameters)
    assert params == ["self", "reset_running_requests", "reset_connector"]
    calls: list[str] = []

    class Base:
        def reset_prefix_cache(
            self, reset_running_requests: bool = False, reset_connector: bool = False
        ) -> bool:
            calls.append(f"pool reset (preempt={reset_running_requests})")
            return True

    class Sched(spatial._ReleasesHoldsOnReset, Base):  # type: ignore[misc]
        def __init__(self, running: list[Any]) -> None:
            self.running = running
            self.connector = SimpleNamespace(release_device_holds=lambda: calls.append("holds released"))

    assert Sched([]).reset_prefix_cache()
    assert calls == ["holds released", "pool reset (preempt=False)"]
    calls.clear()
    Sched(["r1"]).reset_prefix_cache()  # it would fail anyway: the holds stay
    assert calls == ["pool reset (preempt=False)"]
    calls.clear()
    Sched(["r1"]).reset_prefix_cache(reset_running_requests=True)
    assert calls == ["holds released", "pool reset (preempt=True)"]
    for cls in (spatial._SyncSpatialScheduler, spatial._AsyncSpatialScheduler):
        assert issubclass(cls, spatial._ReleasesHoldsOnReset)
    # A KV copy in flight pins device blocks until the workers report it: vLLM would preempt every
    # running request and then raise. The reset is refused instead, with the requests left alone.
    calls.clear()
    busy = Sched(["r1"])
    busy.connector.device_copies_in_flight = lambda: 2
    assert busy.reset_prefix_cache(reset_running_requests=True) is False
    assert calls == [] and busy.running == ["r1"]
    busy.connector.device_copies_in_flight = lambda: 0
    assert busy.reset_prefix_cache(reset_running_requests=True)
    assert calls == ["holds released", "pool reset (preempt=True)"]


def test_a_non_finite_graph_field_makes_a_plain_request_not_a_nan_score() -> None:
    """JSON's 1e999 is infinity: an inf slack over an inf importance would score NaN, and a NaN
    key breaks the heap order for every request queued after it. The wire refuses non-finite
    numbers, so such a request is plain (first come, first served) and the order holds."""
    import math
    import random

    from tokencake.serving.vllm.scheduler_side import request_meta

    queue = ScoredRequestQueue(clock=lambda: 100.0)
    bad = req("bad", 5.0, slack=float("inf"))
    bad.kv_transfer_params[META_KEY]["importance"] = float("inf")
    assert request_meta(bad) is None
    rng = random.Random(7)
    reqs = [bad] + [
        req(f"r{i}", 1.0 + i, slack=rng.uniform(0.0, 90.0), critical=rng.random() < 0.3) for i in range(40)
    ]
    keys = {r.request_id: queue._entry(r)[:3] for r in reqs}
    assert all(math.isfinite(k[0]) for k in keys.values())
    for r in reqs:
        queue.add_request(r)
    assert drain(queue) == sorted(keys, key=keys.__getitem__)


def test_it_keeps_vllms_async_scheduler_when_async_scheduling_is_on() -> None:
    """A ``--scheduler-cls`` that subclassed only ``Scheduler`` would lose async scheduling."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    def config(on: bool) -> Any:
        return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=on))

    assert issubclass(spatial.scheduler_base(config(True)), AsyncScheduler)
    base = spatial.scheduler_base(config(False))
    assert issubclass(base, Scheduler) and not issubclass(base, AsyncScheduler)


def test_waiting_requests_come_out_by_score_then_arrival() -> None:
    now = 1000.0
    q = ScoredRequestQueue(clock=lambda: now)
    q.add_request(req("far", now - 1, slack=60.0))
    q.add_request(req("plain-1", now - 2, plain=True))
    q.add_request(req("crit", now, critical=True))
    q.add_request(req("plain-2", now - 1, plain=True))
    q.add_request(req("old", now - 1000, slack=60.0))  # waited longer than its slack + the head start
    assert len(q) == 5 and q.peek_request().request_id == "old"
    assert [r.request_id for r in q] == ["old", "crit", "plain-1", "plain-2", "far"]  # iteration = order
    assert drain(q) == ["old", "crit", "plain-1", "plain-2", "far"]
    with pytest.raises(IndexError):
        q.peek_request()
    with pytest.raises(IndexError):
        q.pop_request()


def test_vllms_priority_queue_would_not_age() -> None:
    """The difference in one case: vLLM's heap keeps a long-waiting request behind a new one."""
    now = 1000.0
    old, new = req("old", now - 1000, slack=60.0), req("new", now, critical=True)
    old.priority, new.priority = 60, 0  # what the SDK sends (slack in seconds; 0 = critical)
    heap = PriorityRequestQueue()
    scored = ScoredRequestQueue(clock=lambda: now)
    for q in (heap, scored):
        q.add_request(old)
        q.add_request(new)
    assert drain(heap) == ["new", "old"] and drain(scored) == ["old", "new"]


def test_put_back_and_removed_requests() -> None:
    now = 1000.0
    q = ScoredRequestQueue(clock=lambda: now)
    a, b, c = req("a", now - 3, slack=4.0), req("b", now - 1, slack=4.0), req("c", now - 2, slack=4.0)
    q.prepend_requests([a, b, c])
    assert q.pop_request() is a
    a.num_preemptions = 1  # preempted: re-keyed with its preemption when put back
    q.prepend_request(a)
    assert q.peek_request() is a
    q.remove_request(a)
    q.remove_requests({c})
    assert drain(q) == ["b"] and not q and len(q) == 0


def test_a_branch_that_queued_past_its_slack_goes_with_the_critical_path() -> None:
    """The queue tells the score how long each request waited: a branch that fell behind the
    critical path by more than its slack is critical from its next request on."""
    now = 1000.0
    q = ScoredRequestQueue(clock=lambda: now)
    first = req("w0-1", now - 12, slack=10.0, session="run:w0")
    q.add_request(first)
    assert q.pop_request() is first  # waited 12 s; the critical path not at all
    q.add_request(req("w1-2", now - 1, critical=True, session="run:w1"))
    q.add_request(req("w0-2", now, slack=10.0, session="run:w0"))
    q.add_request(req("w2-1", now - 5, slack=10.0, session="run:w2"))  # on plan: its slack holds
    assert drain(q) == ["w1-2", "w0-2", "w2-1"]
    static = ScoredRequestQueue(scorer=SpatialScorer(admission_weights("static-slack")), clock=lambda: now)
    static.add_request(first)
    static.pop_request()
    static.add_request(req("w0-2", now, slack=10.0, session="run:w0"))
    static.add_request(req("w2-1", now - 5, slack=10.0, session="run:w2"))
    assert drain(static) == ["w2-1", "w0-2"]


def test_a_request_whose_session_kv_is_held_is_admitted_first() -> None:
    now = 1000.0
    held = {"run:b"}
    q = ScoredRequestQueue(clock=lambda: now, retained=held.__contains__)
    q.add_request(req("a", now - 3, slack=4.0))
    q.add_request(req("b", now, slack=4.0))  # newer, but its prefetched chain waits on device
    # A plain request is a one-request app: it started 20 s before the agents' app, so it goes
    # first (the app that started first), then the held session (its credit), then the other.
    q.add_request(req("p", now - 20, plain=True))
    assert drain(q) == ["p", "b", "a"]


def test_a_request_whose_session_chain_is_saved_on_host_is_admitted_first() -> None:
    now = 1000.0
    saved, held = {"run:b", "run:c"}, {"run:c"}
    q = ScoredRequestQueue(clock=lambda: now, retained=held.__contains__, saved=saved.__contains__)
    q.add_request(req("a", now - 3, slack=4.0))
    q.add_request(req("b", now, slack=4.0))  # newer, but it resumes with a load from host
    q.add_request(req("c", now + 1, slack=4.0))  # held on device and saved: one credit, not two
    assert drain(q) == ["b", "c", "a"]


def test_a_failing_kv_lookup_costs_the_credit_not_the_engine() -> None:
    now = 1000.0

    def broken(session: str) -> bool:
        raise RuntimeError("boom")

    q = ScoredRequestQueue(clock=lambda: now, retained=broken, saved=broken)
    q.add_request(req("a", now - 3, slack=4.0))
    q.add_request(req("b", now, slack=4.0))
    assert drain(q) == ["a", "b"]  # no credit for anyone: the order by slack and arrival


def test_the_kv_policy_chooses_the_admission_order() -> None:
    """With the continuum policy the queue is Continuum's (FCFS, retained programs first)."""
    from types import SimpleNamespace

    from tokencake.serving.policies import make_policy

    def swapped(policy: str) -> ScoredRequestQueue:
        side = SimpleNamespace(policy=make_policy(policy), holds_kv=lambda session: False)
        sched = vllm_scheduler(side)
        spatial._swap_waiting_queue(sched)
        assert isinstance(sched.waiting, ScoredRequestQueue)
        assert side.critical_last  # critical-path sessions' idle chains are now evicted last
        return sched.waiting

    # critical_last=false (the ``spatial-order`` ablation): the order is swapped, the eviction
    # order and the critical reserve stay off.
    from tokencake.serving.options import Options

    side = SimpleNamespace(
        policy=make_policy("tokencake"), holds_kv=lambda session: False, opts=Options(critical_last=False)
    )
    sched = vllm_scheduler(side)
    spatial._swap_waiting_queue(sched)
    assert isinstance(sched.waiting, ScoredRequestQueue) and side.critical_last is False
    assert sched.waiting.scorer.weights == SpatialWeights()
    # A deployment can name the order (bench system ``apps-side-by-side``).
    side.opts = Options(admission="apps-side-by-side")
    sched = vllm_scheduler(side)
    spatial._swap_waiting_queue(sched)
    assert sched.waiting.scorer.weights == admission_weights("apps-side-by-side") != SpatialWeights()

    now = 1000.0
    for policy, order in (("tokencake", ["c", "a"]), ("continuum", ["a", "c"])):
        q = swapped(policy)
        q.clock = lambda: now
        q.add_request(req("a", now - 5, slack=60.0))
        q.add_request(req("c", now, critical=True))
        assert drain(q) == order, policy


def test_a_failing_lag_count_costs_the_lag_not_the_engine() -> None:
    now = 1000.0
    q = ScoredRequestQueue(clock=lambda: now)

    def broken(*_args: Any, **_kw: Any) -> None:
        raise RuntimeError("boom")

    q.scorer.admitted = broken  # type: ignore[method-assign]
    q.add_request(req("a", now - 3, slack=4.0))
    q.add_request(req("b", now - 1, slack=4.0))
    assert drain(q) == ["a", "b"]


def test_a_failing_ordering_key_queues_the_request_plain_and_never_raises_into_vllm(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``add_request`` runs inside vLLM's ``Scheduler.add_request``: an exception there fails the
    request (or the engine). A scorer that raises queues the request first come, first served."""

    class Broken(SpatialScorer):
        def order_key(self, meta: Any, **kwargs: Any) -> float:
            if meta is not None:
                raise RuntimeError("scorer bug")
            return super().order_key(meta, **kwargs)

    queue = ScoredRequestQueue(scorer=Broken(), clock=lambda: 100.0)
    with caplog.at_level("ERROR", logger="vllm.tokencake.scheduler"):
        for r in (req("b", 2.0, critical=True), req("a", 1.0, slack=5.0), req("p", 3.0, plain=True)):
            queue.add_request(r)
    assert drain(queue) == ["a", "b", "p"]  # all plain now: arrival order
    assert sum("ordering key failed" in r.getMessage() for r in caplog.records) == 1  # logged once

    class Dead(SpatialScorer):
        def order_key(self, meta: Any, **kwargs: Any) -> float:
            raise RuntimeError("scorer bug")

    dead = ScoredRequestQueue(scorer=Dead(), clock=lambda: 100.0)
    for r in (req("y", 2.0), req("x", 1.0)):
        dead.add_request(r)
    assert drain(dead) == ["x", "y"]
