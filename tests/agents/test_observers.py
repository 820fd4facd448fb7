"""Issue 13, SDK point 4d: async observers are awaited (in order), sync ones still work."""

import time

import anyio
import pytest

import tokencake as tc

pytestmark = pytest.mark.anyio


def _app() -> tc.App:
    app = tc.App("observed")

    @app.tool()
    async def lookup(q: str) -> str:
        return q

    @app.agent(calls=[lookup])
    async def agent(ctx, inputs):
        await ctx.llm("hi")
        return await ctx.call(lookup, q="x")

    return app


async def test_async_observer_sees_every_event_in_order_before_run_returns():
    seen: list[str] = []

    async def slow_observer(event: tc.RunEvent) -> None:
        await anyio.sleep(0.02)  # slower than the run itself: events queue up, none is lost
        seen.append(event.kind)

    synced: list[tc.RunEvent] = []
    result = await _app().run(llm=tc.ScriptedLLM("ok"), observer=[slow_observer, synced.append])
    assert seen == [e.kind for e in result.events]  # awaited, all of them, in order
    assert seen[-1] == "run_finished"
    assert synced == result.events


async def test_async_observer_does_not_hold_up_the_nodes():
    app = tc.App("fast_nodes")

    @app.function()
    async def only(ctx, inputs):
        return 1

    delivered: list[float] = []

    async def observer(event):
        await anyio.sleep(0.1)
        delivered.append(time.time())

    result = await app.run(llm=tc.ScriptedLLM("x"), observer=observer)
    node = result.nodes["only"]
    assert node.finished - node.started < 0.05  # the node did not wait for the observer
    assert len(delivered) == len(result.events)
    assert max(delivered) <= time.time()


async def test_sync_callable_returning_a_coroutine_is_awaited_too():
    seen = []

    async def record(event):
        seen.append(event.kind)

    result = await _app().run(llm=tc.ScriptedLLM("ok"), observer=lambda ev: record(ev))
    assert seen == [e.kind for e in result.events]


async def test_failing_async_observer_warns_once_and_the_run_succeeds():
    calls = []

    async def broken(event):
        calls.append(event.kind)
        raise RuntimeError("dashboard down")

    with pytest.warns(RuntimeWarning, match="dashboard down") as warned:
        result = await _app().run(llm=tc.ScriptedLLM("ok"), observer=broken)
    assert result.status == "ok" and result.output == "x"
    assert len(calls) == len(result.events)
    assert len([w for w in warned if "dashboard down" in str(w.message)]) == 1


def test_observer_must_be_callable():
    with pytest.raises(TypeError, match="not callable"):
        _app().run_sync(llm=tc.ScriptedLLM("ok"), observer=[print, 42])
