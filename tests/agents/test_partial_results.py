"""Issue 13, SDK point 4g: a timed-out or cancelled run still says what finished and what did not."""

import time

import anyio
import pytest

import tokencake as tc

pytestmark = pytest.mark.anyio


def _app() -> tc.App:
    """fast -> slow (a 5 s tool) -> after_slow; quick runs beside them."""
    app = tc.App("partial")

    @app.tool(predict_time=5.0)
    async def wait() -> str:
        await anyio.sleep(5.0)
        return "late"

    @app.function()
    async def fast(ctx, inputs):
        return "fast done"

    @app.function()
    async def quick(ctx, inputs):
        return "quick done"

    @app.agent(after=[fast], calls=[wait])
    async def slow(ctx, inputs):
        await ctx.llm("start")
        return await ctx.call(wait)

    @app.function(after=[slow])
    async def after_slow(ctx, inputs):
        return "never"

    return app


async def test_timeout_raises_with_the_partial_result():
    rec = tc.StallRecorder()
    t0 = time.perf_counter()
    with pytest.raises(tc.RunTimeout) as info:
        await _app().run(llm=tc.ScriptedLLM("ok"), stall=rec, timeout=0.3)
    assert time.perf_counter() - t0 < 2.0
    result = info.value.result
    assert result.status == "timeout"
    assert result.completed == ["fast", "quick"]
    assert result.unfinished == ["slow", "after_slow"]
    assert result.outputs == {"fast": "fast done", "quick": "quick done"}
    assert result.nodes["slow"].status == "cancelled" and result.nodes["slow"].llm_calls == 1
    assert result.nodes["after_slow"].status == "pending"
    assert info.value.pending == ["slow", "after_slow"]
    assert [e.outcome for _, e in rec.pairs()] == ["cancelled"]
    finished = result.events[-1]
    assert finished.kind == "run_finished"
    assert finished.data == {
        "status": "timeout",
        "completed": ["fast", "quick"],
        "unfinished": ["slow", "after_slow"],
    }


async def test_cancelled_stream_returns_the_partial_result():
    rec = tc.StallRecorder()
    async with _app().stream(llm=tc.ScriptedLLM("ok"), stall=rec) as run:
        async for event in run:
            if event.kind == "stall_begin":
                run.cancel()  # e.g. the user pressed stop
            last = event
    assert last.kind == "run_result" and last.data["status"] == "cancelled"  # no exception: we asked
    result = run.result
    assert result is last.data["result"] and result.status == "cancelled"
    assert result.completed == ["fast", "quick"]
    assert result.unfinished == ["slow", "after_slow"]
    assert [e.outcome for _, e in rec.pairs()] == ["cancelled"]


async def test_outer_cancellation_still_reports_the_partial_picture_to_observers():
    seen: list[tc.RunEvent] = []
    with anyio.move_on_after(0.3) as scope:
        await _app().run(llm=tc.ScriptedLLM("ok"), observer=seen.append)
    assert scope.cancelled_caught
    finished = [e for e in seen if e.kind == "run_finished"]
    assert len(finished) == 1
    assert finished[0].data["status"] == "cancelled"
    assert finished[0].data["completed"] == ["fast", "quick"]
    assert finished[0].data["unfinished"] == ["slow", "after_slow"]


async def test_failed_run_result_lists_completed_and_unfinished():
    app = tc.App("fails")

    @app.function()
    async def good(ctx, inputs):
        return 1

    @app.function(after=[good])
    async def bad(ctx, inputs):
        raise ValueError("no")

    @app.function(after=[bad])
    async def never(ctx, inputs):
        return 2

    with pytest.raises(tc.NodeFailed) as info:
        await app.run(llm=tc.ScriptedLLM("x"))
    result = info.value.result
    assert (result.status, result.completed, result.unfinished) == ("failed", ["good"], ["bad", "never"])
