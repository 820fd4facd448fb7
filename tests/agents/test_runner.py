import itertools
import json
import time

import anyio
import pytest

import tokencake as tc
from tokencake.events import StallBegin, StallEnd

pytestmark = pytest.mark.anyio


def _stalls(result: tc.RunResult) -> dict[str, tuple[StallBegin, StallEnd]]:
    """tool name -> (begin, end) for runs where each tool runs once."""
    begins = {e.stall_id: e for e in result.stall_events if isinstance(e, StallBegin)}
    ends = {e.stall_id: e for e in result.stall_events if isinstance(e, StallEnd)}
    return {b.tool: (b, ends[sid]) for sid, b in begins.items()}


def _node_times(result: tc.RunResult, kind: str) -> dict[str, float]:
    return {e.node: e.ts for e in result.events if e.kind == kind}


async def test_independent_branches_overlap():
    app = tc.App("branches")

    @app.tool(predict_time=1.0)
    async def slow_async(x: int) -> int:
        await anyio.sleep(1.0)
        return x

    @app.tool(predict_time=1.0)
    def slow_sync(x: int) -> int:
        time.sleep(1.0)  # a blocking tool: must run in a worker thread
        return x

    @app.agent(calls=["slow_async"])
    async def left(ctx, inputs):
        return await ctx.call("slow_async", x=1)

    @app.agent(calls=["slow_sync"])
    async def right(ctx, inputs):
        return await ctx.call(slow_sync, x=2)

    result = await app.run(llm=tc.ScriptedLLM("unused"))
    assert result.output == {"left": 1, "right": 2}
    (b1, e1), (b2, e2) = _stalls(result)["slow_async"], _stalls(result)["slow_sync"]
    overlap = min(e1.ts, e2.ts) - max(b1.ts, b2.ts)
    assert e1.duration_s >= 0.99 and e2.duration_s >= 0.99
    # serial execution would give overlap <= 0; concurrent branches share (almost) the whole second
    assert overlap > 0.8, (b1, e1, b2, e2)
    assert result.nodes["left"].tool_s >= 0.99 and result.nodes["right"].tool_s >= 0.99


async def test_node_starts_as_soon_as_its_own_predecessors_finish():
    app = tc.App("no_rounds")

    @app.function()
    async def fast(ctx, inputs):
        await anyio.sleep(0.05)
        return "f"

    @app.function()
    async def slow(ctx, inputs):
        await anyio.sleep(0.6)
        return "s"

    @app.function(after=[fast])
    async def after_fast(ctx, inputs):
        return inputs

    @app.function(after=[fast, slow])
    async def join(ctx, inputs):
        return inputs

    result = await app.run(llm=tc.ScriptedLLM("x"))
    started = _node_times(result, "node_started")
    finished = _node_times(result, "node_finished")
    assert started["after_fast"] < finished["slow"]  # did not wait for the level to complete
    assert started["join"] >= finished["slow"]
    assert result.outputs["after_fast"] == {"fast": "f"}
    assert result.outputs["join"] == {"fast": "f", "slow": "s"}
    assert result.output == {"after_fast": {"fast": "f"}, "join": {"fast": "f", "slow": "s"}}


async def test_max_concurrency_limits_running_nodes():
    app = tc.App("limited")
    for name in ("a", "b", "c"):

        async def work(ctx, inputs):
            await anyio.sleep(0.1)
            return ctx.node

        app.add_function(work, name=name)
    result = await app.run(llm=tc.ScriptedLLM("x"), max_concurrency=1)
    spans = sorted((r.started, r.finished) for r in result.nodes.values())
    for (_, end1), (start2, _) in itertools.pairwise(spans):
        assert start2 >= end1  # one at a time
    assert max(r.queue_s for r in result.nodes.values()) >= 0.15
    with pytest.raises(ValueError, match="max_concurrency"):
        await app.run(llm=tc.ScriptedLLM("x"), max_concurrency=0)


async def test_failing_node_cancels_siblings_and_names_the_node():
    app = tc.App("failing")
    rec = tc.StallRecorder()

    @app.tool(predict_time=5.0)
    async def long_tool() -> str:
        await anyio.sleep(5)
        return "never"

    @app.agent(calls=["long_tool"])
    async def sibling(ctx, inputs):
        return await ctx.call("long_tool")

    @app.function()
    async def broken(ctx, inputs):
        await anyio.sleep(0.1)
        raise ValueError("boom")

    @app.function(after=[broken, sibling])
    async def downstream(ctx, inputs):
        return "unreachable"

    t0 = time.perf_counter()
    with pytest.raises(tc.NodeFailed) as info:
        await app.run(llm=tc.ScriptedLLM("x"), stall=rec)
    assert time.perf_counter() - t0 < 2.0
    err = info.value
    assert err.node == "broken"
    assert isinstance(err.__cause__, ValueError) and str(err.__cause__) == "boom"
    assert err.original is err.__cause__
    assert "node 'broken' failed: ValueError: boom" in str(err)
    partial = err.result
    assert partial is not None and partial.status == "failed"
    assert partial.nodes["broken"].status == "failed"
    assert partial.nodes["sibling"].status == "cancelled"
    assert partial.nodes["downstream"].status == "pending"
    [(begin, end)] = rec.pairs()
    assert begin.tool == "long_tool" and end is not None and end.outcome == "cancelled"
    kinds = [(e.kind, e.node) for e in partial.events]
    assert ("node_failed", "broken") in kinds and kinds[-1] == ("run_finished", None)


async def test_run_timeout_cancels_everything():
    app = tc.App("timeout")

    @app.tool()
    async def wait() -> None:
        await anyio.sleep(5)

    @app.agent()
    async def waiter(ctx, inputs):
        await ctx.call(wait)

    with pytest.raises(tc.RunTimeout) as info:
        await app.run(llm=tc.ScriptedLLM("x"), timeout=0.2)
    assert info.value.pending == ["waiter"]
    assert "timed out after 0.2 s" in str(info.value)
    assert isinstance(info.value, TimeoutError)
    stalls = info.value.result.stall_events
    assert [e.type for e in stalls] == ["stall_begin", "stall_end"]
    assert stalls[1].outcome == "cancelled"


async def test_tool_retries_each_attempt_is_a_stall():
    app = tc.App("retries")
    attempts = []

    @app.tool(retries=2, predict_time=0.01)
    def flaky(n: int) -> int:
        attempts.append(n)
        if len(attempts) < 3:
            raise ConnectionError(f"try {len(attempts)}")
        return n * 10

    @app.agent()
    async def user(ctx, inputs):
        return await ctx.call(flaky, n=4)

    result = await app.run(llm=tc.ScriptedLLM("x"))
    assert result.output == 40
    ends = [e for e in result.stall_events if isinstance(e, StallEnd)]
    begins = [e for e in result.stall_events if isinstance(e, StallBegin)]
    assert [b.attempt for b in begins] == [1, 2, 3]
    assert [e.outcome for e in ends] == ["error", "error", "ok"]
    assert ends[0].error == "ConnectionError: try 1"
    assert len({b.stall_id for b in begins}) == 3
    assert result.nodes["user"].tool_calls == 3


async def test_tool_timeout_applies_per_attempt_and_raises_tool_timeout():
    app = tc.App("tool_timeout")

    @app.tool(timeout=0.1, retries=1)
    def stuck() -> None:
        time.sleep(0.5)  # a sync tool cannot be interrupted; its thread is abandoned

    @app.agent()
    async def user(ctx, inputs):
        await ctx.call("stuck")

    t0 = time.perf_counter()
    with pytest.raises(tc.NodeFailed) as info:
        await app.run(llm=tc.ScriptedLLM("x"))
    assert time.perf_counter() - t0 < 0.9  # two attempts that waited for the thread: >= 1.0 s
    cause = info.value.__cause__
    assert isinstance(cause, tc.ToolTimeout)
    assert cause.tool == "stuck" and cause.attempts == 2
    ends = [e for e in info.value.result.stall_events if isinstance(e, StallEnd)]
    assert [e.outcome for e in ends] == ["timeout", "timeout"]
    assert all(0.09 <= e.duration_s < 0.45 for e in ends)


async def test_sync_function_nodes_run_in_threads():
    app = tc.App("sync_fn")

    @app.function()
    def one(ctx, inputs):
        time.sleep(0.3)
        return 1

    @app.function()
    def two(ctx, inputs):
        time.sleep(0.3)
        return 2

    result = await app.run(llm=tc.ScriptedLLM("x"))
    assert result.output == {"one": 1, "two": 2}
    n1, n2 = result.nodes["one"], result.nodes["two"]
    assert min(n1.finished, n2.finished) - max(n1.started, n2.started) > 0.15  # overlapped


async def test_run_result_timings_usage_events_and_serialization():
    app = tc.App("result", inputs=["topic"])

    @app.tool(predict_time=0.05)
    async def lookup(q: str) -> dict:
        await anyio.sleep(0.05)
        return {"q": q}

    @app.agent(max_tokens=20, calls=["lookup"])
    async def writer(ctx, inputs):
        first = await ctx.llm(f"write about {ctx.inputs['topic']}")
        found = await ctx.call("lookup", q=first.text)
        second = await ctx.llm(f"found {found}")
        return second.text

    seen: list[tc.RunEvent] = []
    llm = tc.ScriptedLLM(["alpha beta", "gamma delta epsilon"], token_delay=0.01)
    result = await app.run(llm=llm, run_id="r-1", observer=seen.append, topic="cake")
    assert result.run_id == "r-1" and result.app == "result" and result.status == "ok"
    assert result.output == "gamma delta epsilon"
    node = result.nodes["writer"]
    assert node.llm_calls == 2 and node.tool_calls == 1
    assert node.llm_s >= 0.05  # 2 + 3 completion tokens at 10 ms each
    assert node.tool_s >= 0.05 and node.stall_s >= node.tool_s
    assert node.usage.completion_tokens == 5
    assert node.usage.total_tokens == node.usage.prompt_tokens + 5
    assert result.usage == node.usage
    assert node.started <= node.finished and result.wall_s >= node.wall_s
    kinds = [e.kind for e in result.events]
    assert kinds == [
        "run_started",
        "node_ready",
        "node_started",
        "llm_started",
        "llm_finished",
        "tool_started",
        "tool_finished",
        "llm_started",
        "llm_finished",
        "node_finished",
        "run_finished",
    ]
    assert seen == result.events
    data = json.loads(json.dumps(result.to_dict()))
    assert data["nodes"]["writer"]["usage"]["completion_tokens"] == 5
    assert data["stall_events"][0]["type"] == "stall_begin"
    table = result.timings_table()
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["node", "status", "start", "wall"]
    assert lines[2].split()[:2] == ["writer", "ok"]
    assert lines[-1].split()[0] == "total"


async def test_broken_observer_warns_but_does_not_fail_the_run():
    app = tc.App("observer")

    @app.function()
    async def only(ctx, inputs):
        return 1

    def observer(ev):
        raise RuntimeError("display crashed")

    with pytest.warns(RuntimeWarning, match="display crashed"):
        result = await app.run(llm=tc.ScriptedLLM("x"), observer=observer)
    assert result.output == 1


async def test_code_writer_dag_runs_in_dependency_order(code_writer):
    app = code_writer
    llm = tc.ScriptedLLM(lambda req: f"{req.node} done")

    result = await app.run(llm=llm, run_id="cw")
    assert all(r.status == "ok" for r in result.nodes.values())
    started = _node_times(result, "node_started")
    finished = _node_times(result, "node_finished")
    for src, dst in app.graph.edges:
        assert started[dst] >= finished[src], (src, dst)
    assert result.outputs == {n: n for n in app.graph}
    assert len(llm.requests) == 27
    priority = {r["kv_transfer_params"]["tokencake"]["node"]: r["priority"] for r in llm.requests}
    assert priority["external_eval"] == 36
    assert {p for n, p in priority.items() if n != "external_eval"} == {0}
    # 18 graph-fixed tool calls (2 searches, 2 checks, 6 file writes, 5 validations, eval, confirm, tests)
    assert len(result.stall_events) == 2 * 18
    assert result.nodes["user_confirm"].tool_calls == 1
