import json
import socket
import warnings

import anyio
import httpx
import pytest

import tokencake as tc
from tokencake.events import EVENTS_PATH, StallBegin, StallEnd, parse_event

pytestmark = pytest.mark.anyio


def _mixed_app() -> tc.App:
    """One agent making four tool calls: ok, raising, timing out, ok."""
    app = tc.App("mixed")

    @app.tool(predict_time=0.01, kind="search", stages={"query": 0.005, "execute": 0.005})
    async def good(x: int) -> int:
        await anyio.sleep(0.01)
        return x

    @app.tool()
    def bad() -> None:
        raise KeyError("missing thing")

    @app.tool(timeout=0.05)
    async def hang() -> None:
        await anyio.sleep(10)

    @app.agent(calls=["good", "bad", "hang", "good"])
    async def worker(ctx, inputs):
        await ctx.call(good, x=1)
        with pytest.raises(KeyError):
            await ctx.call(bad)
        with pytest.raises(tc.ToolTimeout):
            await ctx.call(hang)
        return await ctx.call(good, x=2)

    return app


def _assert_pairs(events: list, tools: list[str], outcomes: list[str]) -> None:
    """Exactly len(tools) begin/end pairs, strictly begin-then-end in order, ids matched."""
    assert len(events) == 2 * len(tools)
    ids = set()
    for i, tool in enumerate(tools):
        begin, end = events[2 * i], events[2 * i + 1]
        assert isinstance(begin, StallBegin) and isinstance(end, StallEnd)
        assert begin.stall_id == end.stall_id and begin.stall_id not in ids
        ids.add(begin.stall_id)
        assert begin.tool == end.tool == tool
        assert begin.session_id == end.session_id and begin.node == end.node
        assert end.ts >= begin.ts
        assert end.outcome == outcomes[i]


async def test_every_tool_call_is_one_begin_end_pair_whatever_the_outcome():
    rec = tc.StallRecorder()
    result = await _mixed_app().run(llm=tc.ScriptedLLM("x"), stall=rec, run_id="mix")
    assert result.output == 2
    _assert_pairs(rec.events, ["good", "bad", "hang", "good"], ["ok", "error", "timeout", "ok"])
    assert rec.events == result.stall_events
    first: StallBegin = rec.events[0]
    assert first.session_id == "mix:worker" and first.run_id == "mix" and first.agent_type == "mixed.worker"
    assert first.kind == "search" and first.predicted_s == 0.01
    assert first.stages == {"query": 0.005, "execute": 0.005} and first.attempt == 1
    bad_end, hang_end = rec.events[3], rec.events[5]
    assert bad_end.error == "KeyError: 'missing thing'"
    assert hang_end.error == "tool 'hang' timed out after 0.05 s"
    assert 0.04 <= hang_end.duration_s < 1.0
    assert [b for b, _ in rec.pairs()] == rec.events[::2]
    # the events are valid wire events
    for ev in rec.events:
        assert parse_event(ev.model_dump_json()) == ev


class _SlowEndHook:
    """Awaits inside end(): without a shielded scope the cancellation would kill the send."""

    def __init__(self) -> None:
        self.ends: list[StallEnd] = []

    async def begin(self, ev: StallBegin) -> None:
        pass

    async def end(self, ev: StallEnd) -> None:
        await anyio.sleep(0.05)
        self.ends.append(ev)


async def test_run_cancelled_mid_tool_still_ends_the_stall():
    app = tc.App("cancel")

    @app.tool()
    async def quick() -> str:
        return "q"

    @app.tool(predict_time=30.0)
    async def forever() -> None:
        await anyio.sleep(30)

    @app.agent()
    async def worker(ctx, inputs):
        await ctx.call(quick)
        await ctx.call(forever)

    rec, slow = tc.StallRecorder(), _SlowEndHook()
    with anyio.move_on_after(0.2) as scope:
        await app.run(llm=tc.ScriptedLLM("x"), stall=[rec, slow])
    assert scope.cancelled_caught
    _assert_pairs(rec.events, ["quick", "forever"], ["ok", "cancelled"])
    assert [e.outcome for e in slow.ends] == ["ok", "cancelled"]
    assert rec.events[3].duration_s < 1.0


async def test_failing_custom_hook_never_fails_the_tool():
    class Broken:
        async def begin(self, ev):
            raise RuntimeError("hook down")

        async def end(self, ev):
            raise RuntimeError("hook down")

    with pytest.warns(RuntimeWarning, match="hook down"):
        result = await _mixed_app().run(llm=tc.ScriptedLLM("x"), stall=Broken())
    assert result.output == 2
    with pytest.raises(TypeError, match="begin"):
        await _mixed_app().run(llm=tc.ScriptedLLM("x"), stall=object())


def _refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there any more


async def test_reporter_against_a_server_without_the_extension_404():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(404, text="Not Found")  # plain vLLM: no such route

    reporter = tc.HttpStallReporter("http://vllm:8001/", transport=httpx.MockTransport(handler))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = await _mixed_app().run(llm=tc.ScriptedLLM("x"), stall=reporter)
    assert result.output == 2  # every tool behaved as without a reporter
    assert reporter.failures == 8 and reporter.sent == 0
    assert "HTTP 404" in reporter.last_error
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert str(seen[0].url) == "http://vllm:8001" + EVENTS_PATH
    assert "authorization" not in seen[0].headers


async def test_reporter_against_a_refused_port():
    reporter = tc.HttpStallReporter(_refused_url(), timeout=1.0)
    with pytest.warns(RuntimeWarning, match="stall events are not reaching"):
        result = await _mixed_app().run(llm=tc.ScriptedLLM("x"), stall=reporter)
    assert result.output == 2
    assert reporter.failures == 8
    assert "ConnectError" in reporter.last_error
    await reporter.aclose()


async def test_reporter_delivers_events_with_bearer_token():
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer s3cret"
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"ok": True, "status": "recorded", "decision": "offload"})

    reporter = tc.HttpStallReporter("http://x:1", api_key="s3cret", transport=httpx.MockTransport(handler))
    rec = tc.StallRecorder()
    await _mixed_app().run(llm=tc.ScriptedLLM("x"), stall=[rec, reporter])
    assert reporter.sent == 8 and reporter.failures == 0
    assert [parse_event(b) for b in bodies] == rec.events
    assert reporter.last_ack is not None and reporter.last_ack.decision == "offload"


async def test_reporter_counts_rejections_and_backs_off_after_a_timeout():
    def reject(request: httpx.Request) -> httpx.Response:
        return httpx.Response(409, json={"ok": False, "status": "rejected", "reason": "end_before_begin"})

    reporter = tc.HttpStallReporter("http://x:1", transport=httpx.MockTransport(reject))
    with pytest.warns(RuntimeWarning, match="end_before_begin"):
        await _mixed_app().run(llm=tc.ScriptedLLM("x"), stall=reporter)
    assert reporter.rejected == 8 and reporter.failures == 0

    calls = 0

    def timeout(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ReadTimeout("slow", request=request)

    reporter = tc.HttpStallReporter("http://x:1", transport=httpx.MockTransport(timeout), cooldown_s=60)
    with pytest.warns(RuntimeWarning, match="timeout"):
        result = await _mixed_app().run(llm=tc.ScriptedLLM("x"), stall=reporter)
    assert result.output == 2
    assert calls == 1 and reporter.failures == 1 and reporter.dropped == 7


async def test_llm_events_url_adds_its_reporter_automatically():
    llm = tc.ScriptedLLM("x", events_url=_refused_url())
    rec = tc.StallRecorder()
    with pytest.warns(RuntimeWarning):
        result = await _mixed_app().run(llm=llm, stall=rec)
    reporter = llm.stall_reporter()
    assert reporter is not None and reporter is llm.stall_reporter()
    assert result.output == 2 and reporter.failures == 8 and len(rec.events) == 8
    # listing the LLM's reporter explicitly does not send twice; stall=False sends nothing
    await _mixed_app().run(llm=llm, stall=[reporter])
    assert reporter.failures == 16
    await _mixed_app().run(llm=llm, stall=False)
    assert reporter.failures == 16
    await llm.aclose()


async def test_the_end_of_a_delivered_begin_is_sent_even_in_the_cooldown():
    # Parallel tools a and b: a's begin is recorded, b's begin times out (a cooldown starts).
    # a's end must still go out, or the server holds a's copies until the stall expires.
    app = tc.App("owed")

    @app.tool(predict_time=0.1)
    async def a() -> str:
        await anyio.sleep(0.2)
        return "a"

    @app.tool(predict_time=0.1)
    async def b() -> str:
        return "b"

    @app.agent(tools=[a, b])
    async def agent(ctx, inputs):
        return (await ctx.llm("go")).text

    seen: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["type"] == "stall_begin" and body["tool"] == "b":
            raise httpx.ReadTimeout("slow", request=request)
        seen.append((body["type"], body["tool"]))
        return httpx.Response(200, json={"ok": True, "status": "recorded"})

    reporter = tc.HttpStallReporter("http://x:1", transport=httpx.MockTransport(handler), cooldown_s=60)
    script = {
        "agent": [
            [tc.ToolCall(id="1", name="a", arguments={}), tc.ToolCall(id="2", name="b", arguments={})],
            "ok",
        ]
    }
    with pytest.warns(RuntimeWarning, match="timeout"):
        await app.run(llm=tc.ScriptedLLM(script), stall=reporter)
    assert ("stall_begin", "a") in seen and ("stall_end", "a") in seen
    assert ("stall_end", "b") not in seen and reporter.dropped == 1  # b's end: its begin never arrived


async def test_a_rerun_with_the_same_run_id_gets_new_stall_ids():
    # The server keeps finished stall ids and answers a repeated one "duplicate" (doing nothing):
    # a retried job reusing its run_id must still get its tool calls handled.
    ids = []
    for _ in range(2):
        rec = tc.StallRecorder()
        await _mixed_app().run(llm=tc.ScriptedLLM("x"), stall=rec, run_id="job-42")
        ids.append({b.stall_id for b, _ in rec.pairs()})
    assert ids[0] and not ids[0] & ids[1]


async def test_stall_ids_fit_the_wire_whatever_the_run_id_and_node_names():
    rec = tc.StallRecorder()
    await _mixed_app().run(llm=tc.ScriptedLLM("x"), stall=rec, run_id="r" * 80)
    assert rec.pairs() and all(len(b.stall_id) <= 200 for b, _ in rec.pairs())


async def test_the_tool_does_not_wait_for_the_begin_ack_and_the_end_follows_it():
    """Under asyncio the begin is posted beside the tool: a slow ack no longer delays every tool
    call, and the server still gets the begin before the end (the end waits for it)."""
    import time

    order: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["type"] == "stall_begin":
            await anyio.sleep(0.5)
        order.append(body["type"])
        return httpx.Response(200, json={"ok": True, "status": "recorded"})

    app = tc.App("unheld")
    started: list[float] = []

    @app.tool(predict_time=0.1)
    async def t() -> str:
        started.append(time.perf_counter())
        return "t"

    @app.agent(tools=[t])
    async def agent(ctx, inputs):
        return (await ctx.llm("go")).text

    reporter = tc.HttpStallReporter("http://x:1", transport=httpx.MockTransport(handler))
    script = {"agent": [[tc.ToolCall(id="1", name="t", arguments={})], "ok"]}
    t0 = time.perf_counter()
    result = await app.run(llm=tc.ScriptedLLM(script), stall=reporter)
    assert result.output == "ok"
    assert started[0] - t0 < 0.3  # the tool ran while the begin's ack was still on its way
    assert order == ["stall_begin", "stall_end"] and reporter.sent == 2


async def test_closing_the_reporter_finishes_the_begins_still_being_posted():
    bodies: list[dict] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(0.1)
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"ok": True, "status": "recorded"})

    reporter = tc.HttpStallReporter("http://x:1", transport=httpx.MockTransport(handler))
    ev = StallBegin(stall_id="s", session_id="a", run_id="r", node="n", tool="t", ts=0.0)
    await reporter.begin(ev)
    assert bodies == []  # posted in the background
    await reporter.aclose()
    assert [b["stall_id"] for b in bodies] == ["s"] and reporter.sent == 1


async def test_the_end_is_sent_even_when_posting_its_begin_failed_unexpectedly():
    sent: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["type"] == "stall_begin":
            raise RuntimeError("broken transport")  # not an httpx error: _send does not catch it
        sent.append(body["type"])
        return httpx.Response(200, json={"ok": True, "status": "recorded"})

    reporter = tc.HttpStallReporter("http://x:1", transport=httpx.MockTransport(handler))
    begin = StallBegin(stall_id="s", session_id="a", run_id="r", node="n", tool="t", ts=0.0)
    await reporter.begin(begin)
    with pytest.warns(RuntimeWarning, match="broken transport"):
        await reporter.end(
            StallEnd(
                stall_id="s",
                session_id="a",
                run_id="r",
                node="n",
                tool="t",
                ts=1.0,
                outcome="ok",
                duration_s=1.0,
            )
        )
    assert sent == ["stall_end"] and reporter.failures == 1
    await reporter.aclose()
