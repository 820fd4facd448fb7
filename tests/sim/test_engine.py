"""The engine model against hand-computed small cases (tokencake/sim/engine.py).

The profile makes the arithmetic easy: a step costs 1 s + 0.01 s per prefill token, blocks hold 4
tokens, the token budget is 8, and decode costs nothing beyond the step.
"""

from __future__ import annotations

import pytest

from tokencake.sim.engine import Engine, Request, Session
from tokencake.sim.profiles import get_profile

PROFILE = get_profile("cpu-measured").with_(
    name="unit",
    block_size=4,
    max_batched_tokens=8,
    max_num_seqs=8,
    step_s=1.0,
    prefill_s_per_token=0.01,
    attn_s_per_token_ctx=0.0,
    decode_s_per_seq=0.0,
    decode_s_per_ctx_token=0.0,
)


def run(engine: Engine) -> list[Request]:
    done = []
    while engine.has_work():
        done += engine.step()
    return done


def session(name: str, group: str | None = None, prefix: int = 0) -> Session:
    return Session(name, "agent", 4, group, prefix)


def test_one_request_alone() -> None:
    engine = Engine(PROFILE, device_blocks=8)
    req = Request(0, session("a"), prompt_tokens=10, output_tokens=3, arrival=0.0)
    engine.submit(req)
    assert run(engine) == [req]
    # 8 tokens (1.08 s), the last 2 + first token (1.02 s), then 2 decode steps (1 s each).
    assert req.first_token_at == pytest.approx(2.10)
    assert req.finished_at == pytest.approx(4.10)
    assert engine.computed_prompt_tokens == 10 and engine.local_hit_tokens == 0
    # Its 3 full blocks (12 tokens of prompt + output) stay cached after it finished.
    assert len(engine.cache.match(session("a").keys(3))) == 3 and engine.cache.num_free == 8


def test_two_requests_sharing_a_prefix() -> None:
    engine = Engine(PROFILE, device_blocks=8)
    first = Request(0, session("a", "sys", 8), prompt_tokens=9, output_tokens=1, arrival=0.0)
    engine.submit(first)
    run(engine)
    second = Request(1, session("b", "sys", 8), prompt_tokens=13, output_tokens=1, arrival=engine.now)
    engine.submit(second)
    start = engine.now
    run(engine)
    # The 2 shared blocks (8 tokens) hit; the 5 other prompt tokens are computed in one step.
    assert second.local_tokens == 8 and second.computed_prompt_tokens == 5
    assert second.finished_at - start == pytest.approx(1.05)


def test_eviction_takes_the_idle_chain_tail_first() -> None:
    engine = Engine(PROFILE, device_blocks=4)
    a = Request(0, session("a"), prompt_tokens=8, output_tokens=1, arrival=0.0)
    engine.submit(a)
    run(engine)  # 2 full blocks cached, idle
    b = Request(1, session("b"), prompt_tokens=11, output_tokens=1, arrival=engine.now)
    engine.submit(b)
    run(engine)  # needs 3 blocks: the 2 never used, then a's tail
    assert (
        engine.cache.match(session("a").keys(2)) != [] and len(engine.cache.match(session("a").keys(2))) == 1
    )
    again = Request(2, session("a"), prompt_tokens=9, output_tokens=1, arrival=engine.now)
    engine.submit(again)
    run(engine)
    assert again.local_tokens == 4 and again.computed_prompt_tokens == 5


def test_preemption_by_recompute_when_decode_runs_out_of_blocks() -> None:
    engine = Engine(PROFILE, device_blocks=4)
    a = Request(0, session("a"), prompt_tokens=4, output_tokens=6, arrival=0.0)
    b = Request(1, session("b"), prompt_tokens=4, output_tokens=6, arrival=0.0)
    engine.submit(a)
    engine.submit(b)
    done = run(engine)
    assert set(done) == {a, b}
    # Each needs 3 blocks by its last token; 4 blocks hold both only until the decodes grow.
    assert engine.preemptions >= 1 and b.preemptions >= 1 and a.preemptions == 0
    assert engine.computed_prompt_tokens > 8  # b's context was computed again


def test_priority_scheduling_admits_and_preempts_by_priority() -> None:
    engine = Engine(PROFILE, device_blocks=4, scheduling="priority")
    low = Request(0, session("low"), prompt_tokens=4, output_tokens=6, arrival=0.0, priority=5)
    high = Request(1, session("high"), prompt_tokens=4, output_tokens=6, arrival=0.1, priority=0)
    engine.submit(low)
    engine.submit(high)
    assert list(engine.waiting) == [high, low]  # the queue is ordered by priority, then arrival
    done = run(engine)
    assert set(done) == {low, high}
    # When the decodes outgrow 4 blocks the low-priority request is the victim, though it came first.
    assert low.preemptions >= 1 and high.preemptions == 0
    assert high.finished_at < low.finished_at
    with pytest.raises(ValueError, match="scheduling"):
        Engine(PROFILE, scheduling="lifo")


def test_spatial_scheduling_admits_by_the_spatial_score() -> None:
    """The critical path first (priority 0 with an app), then plain requests, then by slack; a
    request that waited longer than the critical path's head start goes first; the victim is
    chosen as under ``priority``."""
    from tokencake.serving.spatial import SpatialWeights

    engine = Engine(PROFILE, device_blocks=4, scheduling="spatial")
    head = SpatialWeights().critical_s
    slack = Request(0, session("slack"), 4, 6, arrival=0.0, priority=20, run_id="app1")
    plain = Request(1, session("plain"), 4, 6, arrival=0.1)
    crit = Request(2, session("crit"), 4, 6, arrival=0.2, priority=0, run_id="app2")
    waited = (head + 30.0) / SpatialWeights().aging  # longer than the head start and the slack
    old = Request(3, session("old"), 4, 6, arrival=-waited, priority=20, run_id="app3")
    for req in (slack, plain, crit, old):
        engine.submit(req)
    assert list(engine.waiting) == [old, crit, plain, slack]
    done = run(engine)
    assert set(done) == {slack, plain, crit, old}
    assert crit.preemptions == 0  # the victims are the high-priority numbers, as vLLM picks them


def test_the_spatial_queue_orders_by_the_kv_policys_admission_or_the_configured_one() -> None:
    """As the connector's: Continuum's policy brings Continuum's order; ``admission`` names one."""
    from tokencake.serving.options import Options
    from tokencake.serving.spatial import SpatialWeights, admission_weights
    from tokencake.sim.extension import KVExtension

    def weights(**opts: object) -> SpatialWeights:
        ext = KVExtension(Options(**opts), host_blocks=8)  # type: ignore[arg-type]
        return Engine(PROFILE, device_blocks=8, extension=ext, scheduling="spatial").scorer.weights

    assert Engine(PROFILE, scheduling="spatial").scorer.weights == SpatialWeights()
    assert weights(policy="tokencake") == SpatialWeights()
    assert weights(policy="continuum") == admission_weights("continuum")
    assert weights(policy="tokencake", admission="apps-side-by-side") == admission_weights(
        "apps-side-by-side"
    )
