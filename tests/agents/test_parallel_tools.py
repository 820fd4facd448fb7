"""Issue 13, SDK point 4b: a turn's tool calls run concurrently, one stall each, results in model order."""

import time

import anyio
import pytest

import tokencake as tc
from tokencake.events import StallBegin, StallEnd

pytestmark = pytest.mark.anyio


def _app(delays: dict[int, float]) -> tc.App:
    app = tc.App("parallel")

    @app.tool(predict_time=0.3, kind="search")
    async def fetch(n: int) -> str:
        await anyio.sleep(delays[n])
        return f"doc{n}"

    @app.tool(predict_time=0.3)
    def blocking(n: int) -> str:
        time.sleep(delays[n])  # sync tools run in worker threads, so they overlap as well
        return f"sync{n}"

    @app.agent(tools=[fetch, blocking])
    async def researcher(ctx, inputs):
        return (await ctx.llm("read everything")).text

    return app


def _parallel_script() -> list:
    return [
        [
            tc.ToolCall(id="a", name="fetch", arguments={"n": 1}),
            tc.ToolCall(id="b", name="fetch", arguments={"n": 2}),
            tc.ToolCall(id="c", name="blocking", arguments={"n": 3}),
        ],
        lambda req: " | ".join(req.tool_results),
    ]


async def test_parallel_tool_calls_overlap_with_one_stall_each_in_model_order():
    # the first call is the slowest: run one after another they would finish in model order
    app = _app({1: 0.5, 2: 0.4, 3: 0.3})
    llm = tc.ScriptedLLM({"researcher": _parallel_script()})
    rec = tc.StallRecorder()
    result = await app.run(llm=llm, stall=rec)

    # one begin/end pair per call, all begun before any ended (they overlapped; no wall-clock
    # bound, which a loaded machine would break)
    pairs = rec.pairs()
    assert [b.tool for b, _ in pairs] == ["fetch", "fetch", "blocking"]
    assert all(e is not None and e.outcome == "ok" for _, e in pairs)
    assert len({b.stall_id for b, _ in pairs}) == 3
    kinds = [type(e) for e in rec.events]
    assert kinds == [StallBegin] * 3 + [StallEnd] * 3
    assert {b.session_id for b, _ in pairs} == {f"{result.run_id}:researcher"}

    # they finished in reverse order, but the model reads the results in its own order
    finished = [e.data["stall_id"] for e in result.events if e.kind == "tool_finished"]
    assert finished == [b.stall_id for b, _ in reversed(pairs)]
    second = llm.requests[1]["messages"]
    tool_msgs = [m for m in second if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == ["a", "b", "c"]
    assert [m["content"] for m in tool_msgs] == ["doc1", "doc2", "sync3"]
    assert result.output == "doc1 | doc2 | sync3"
    assert result.nodes["researcher"].tool_calls == 3


async def test_tool_error_in_one_call_goes_back_to_the_model_others_succeed():
    app = tc.App("partial_errors")

    @app.tool()
    async def check(n: int) -> str:
        await anyio.sleep(0.05)
        if n == 2:
            raise tc.ToolError("n=2 is not allowed")
        return f"ok{n}"

    @app.agent(tools=[check])
    async def agent(ctx, inputs):
        return (await ctx.llm("check")).text

    script = [
        [tc.ToolCall(id=f"c{n}", name="check", arguments={"n": n}) for n in (1, 2, 3)],
        lambda req: " | ".join(req.tool_results),
    ]
    rec = tc.StallRecorder()
    result = await app.run(llm=tc.ScriptedLLM(script), stall=rec)
    assert result.output == "ok1 | error: n=2 is not allowed | ok3"
    assert [e.outcome for _, e in rec.pairs()] == ["ok", "error", "ok"]


async def test_crashing_call_cancels_its_siblings_and_fails_the_node():
    app = tc.App("crash")

    @app.tool()
    async def slow() -> str:
        await anyio.sleep(5)
        return "never"

    @app.tool()
    async def broken() -> str:
        await anyio.sleep(0.05)
        raise KeyError("bug in the tool")

    @app.agent(tools=[slow, broken])
    async def agent(ctx, inputs):
        return (await ctx.llm("go")).text

    script = [[tc.ToolCall(id="s", name="slow"), tc.ToolCall(id="b", name="broken")]]
    rec = tc.StallRecorder()
    t0 = time.perf_counter()
    with pytest.raises(tc.NodeFailed) as info:
        await app.run(llm=tc.ScriptedLLM(script), stall=rec)
    assert time.perf_counter() - t0 < 2
    assert isinstance(info.value.__cause__, KeyError)
    outcomes = {b.tool: e.outcome for b, e in rec.pairs()}
    assert outcomes == {"slow": "cancelled", "broken": "error"}
