"""A cancellation that no cancel scope asked for is a failure of the code that raised it.

Left as a cancellation it ends its task in the run's task group without counting as an error:
the other nodes are cancelled and the run used to report "ok" with nodes never run.
"""

import asyncio

import anyio
import pytest

import tokencake as tc

pytestmark = pytest.mark.anyio


async def _cancelled_future() -> None:
    fut = asyncio.get_running_loop().create_future()
    fut.cancel()  # another task cancelled what this code waits for
    await fut


def _app(where: str) -> tc.App:
    app = tc.App("stray")

    @app.tool(predict_time=0.1)
    async def flaky() -> str:
        await _cancelled_future()
        return "never"

    @app.tool(predict_time=0.1)
    async def slow() -> str:
        await anyio.sleep(0.2)
        return "slow"

    @app.agent(tools=[flaky, slow] if where == "parallel" else [], calls=[flaky] if where == "call" else [])
    async def a(ctx, inputs):
        if where == "node":
            await _cancelled_future()
        if where == "call":
            return await ctx.call(flaky)
        return (await ctx.llm("go")).text

    @app.function(after=[a])
    def b(ctx, inputs):
        return "b ran"

    return app


@pytest.mark.parametrize("where", ["node", "call", "parallel"])
async def test_a_stray_cancellation_fails_the_run_instead_of_reporting_ok(where: str) -> None:
    script = {
        "a": [
            [tc.ToolCall(id="1", name="flaky", arguments={}), tc.ToolCall(id="2", name="slow", arguments={})],
            "done",
        ]
    }
    rec = tc.StallRecorder()
    with pytest.raises(tc.NodeFailed) as info:
        await _app(where).run(llm=tc.ScriptedLLM(script), stall=rec)
    assert info.value.node == "a"
    assert "CancelledError" in str(info.value)
    assert info.value.result is not None and info.value.result.status == "failed"
    assert all(end is not None for _begin, end in rec.pairs())  # every stall still ended


async def test_a_real_cancellation_still_cancels_the_run() -> None:
    app = tc.App("cancel")

    @app.agent()
    async def a(ctx, inputs):
        await anyio.sleep(10)

    with anyio.move_on_after(0.1) as scope:
        await app.run(llm=tc.ScriptedLLM("x"))
    assert scope.cancelled_caught
