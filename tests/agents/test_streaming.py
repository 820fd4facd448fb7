"""Issue 13, SDK point 4c: ``ctx.llm(..., stream=True)`` and ``app.stream(...)``."""

import time

import anyio
import pytest

import tokencake as tc
from tokencake.events import StallBegin, StallEnd

pytestmark = pytest.mark.anyio


async def test_llm_stream_yields_deltas_as_they_arrive_and_records_the_reply():
    app = tc.App("stream_text")
    got: dict = {}

    @app.agent(max_tokens=50)
    async def writer(ctx, inputs):
        stream = ctx.llm("write", stream=True)
        assert isinstance(stream, tc.LLMStream)
        got["deltas"] = [(delta, time.perf_counter()) async for delta in stream]
        got["reply"] = stream.reply
        got["messages"] = list(ctx.messages)
        return stream.text

    llm = tc.ScriptedLLM("alpha beta gamma delta", token_delay=0.05)
    result = await app.run(llm=llm)
    deltas = [d for d, _ in got["deltas"]]
    assert deltas == ["alpha ", "beta ", "gamma ", "delta"]
    first, last = got["deltas"][0][1], got["deltas"][-1][1]
    assert last - first >= 0.12  # the words came one by one, not in one block at the end
    reply = got["reply"]
    assert reply.text == "alpha beta gamma delta" and reply.finish_reason == "stop"
    assert reply.usage.completion_tokens == 4 and reply.usage.prompt_tokens > 0
    assert got["messages"][-1] == {"role": "assistant", "content": "alpha beta gamma delta"}
    assert result.output == "alpha beta gamma delta"
    node = result.nodes["writer"]
    assert node.llm_calls == 1 and node.usage == reply.usage
    body = llm.requests[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["kv_transfer_params"]["tokencake"]["session_id"] == f"{result.run_id}:writer"
    finished = [e for e in result.events if e.kind == "llm_finished"]
    assert finished[0].data["completion_tokens"] == 4


async def test_streamed_tool_loop_runs_tools_between_streamed_turns():
    app = tc.App("stream_tools")

    @app.tool(predict_time=0.1)
    async def lookup(term: str) -> str:
        await anyio.sleep(0.05)
        return f"{term} is a dessert"

    @app.agent(tools=[lookup])
    async def agent(ctx, inputs):
        stream = ctx.llm("what is cake?", stream=True)
        deltas = [d async for d in stream]
        return deltas, stream.reply

    script = [
        {
            "content": "Let me check. ",
            "tool_calls": [tc.ToolCall(id="t1", name="lookup", arguments={"term": "cake"})],
        },
        lambda req: f"It says: {req.tool_results[0]}",
    ]
    rec = tc.StallRecorder()
    llm = tc.ScriptedLLM(script)
    result = await app.run(llm=llm, stall=rec)
    deltas, reply = result.output
    assert "".join(deltas) == "Let me check. It says: cake is a dessert"
    assert reply.turns == 2 and reply.text == "It says: cake is a dessert"
    assert [(b.tool, e.outcome) for b, e in rec.pairs()] == [("lookup", "ok")]
    # the streamed tool call arrived in pieces and was assembled with its arguments
    tool_msg = [m for m in llm.requests[1]["messages"] if m["role"] == "tool"]
    assert tool_msg == [{"role": "tool", "tool_call_id": "t1", "content": "cake is a dessert"}]
    assert llm.requests[1]["messages"][-2]["tool_calls"][0]["function"]["arguments"] == '{"term": "cake"}'
    assert result.nodes["agent"].llm_calls == 2


async def test_closing_a_stream_early_keeps_the_text_so_far_in_the_conversation():
    app = tc.App("stream_abort")

    @app.agent()
    async def agent(ctx, inputs):
        async with ctx.llm("talk", stream=True) as stream:
            async for delta in stream:
                first = delta
                break
        partial = dict(ctx.messages[-1])
        follow = await ctx.llm("go on")
        return first, partial, follow.text

    llm = tc.ScriptedLLM(["one two three four", "five"], token_delay=0.02)
    result = await app.run(llm=llm)
    first, partial, follow = result.output
    assert first == "one "
    assert partial == {"role": "assistant", "content": "one "}
    assert follow == "five"
    # the next request continues the same conversation after the partial reply
    assert llm.requests[1]["messages"][-2:] == [partial, {"role": "user", "content": "go on"}]
    failed = [e for e in result.events if e.kind == "llm_failed"]
    assert [e.data["error"] for e in failed] == ["cancelled"]


async def test_stream_cannot_be_combined_with_output_type():
    from pydantic import BaseModel

    class Out(BaseModel):
        x: int

    app = tc.App("stream_output")

    @app.agent()
    async def agent(ctx, inputs):
        ctx.llm("x", stream=True, output_type=Out)

    with pytest.raises(tc.NodeFailed, match="cannot be combined"):
        await app.run(llm=tc.ScriptedLLM("x"))


def _tool_app(tool_s: float = 0.05) -> tc.App:
    app = tc.App("streamed_run", inputs=["task"])

    @app.tool(predict_time=tool_s, kind="search")
    async def search(q: str) -> str:
        await anyio.sleep(tool_s)
        return f"hits for {q}"

    @app.agent(calls=[search])
    async def researcher(ctx, inputs):
        first = await ctx.llm(ctx.inputs["task"])
        hits = await ctx.call(search, q=first.text)
        return (await ctx.llm(hits)).text

    @app.function(after=[researcher])
    def report(ctx, inputs):
        return inputs["researcher"].upper()

    return app


async def test_app_stream_yields_every_event_then_the_result():
    app = _tool_app()
    received: list[tuple[tc.RunEvent, float]] = []
    async with app.stream(task="cakes", llm=tc.ScriptedLLM(["query", "answer"]), run_id="s-1") as run:
        assert isinstance(run, tc.RunStream) and run.run_id == "s-1"
        async for event in run:
            received.append((event, time.time()))
    events = [e for e, _ in received]
    kinds = [e.kind for e in events]
    assert kinds == [
        "run_started",
        "node_ready",
        "node_started",
        "llm_started",
        "llm_finished",
        "tool_started",
        "stall_begin",
        "stall_end",
        "tool_finished",
        "llm_started",
        "llm_finished",
        "node_finished",
        "node_ready",
        "node_started",
        "node_finished",
        "run_finished",
        "run_result",
    ]
    result = run.result
    assert events[-1].data["result"] is result and result.output == "ANSWER"
    assert all(e.run_id == "s-1" for e in events)
    begin, end = events[kinds.index("stall_begin")], events[kinds.index("stall_end")]
    assert isinstance(begin.data["event"], StallBegin) and isinstance(end.data["event"], StallEnd)
    assert begin.data["event"].stall_id == end.data["event"].stall_id
    # the stream-only events are not part of the recorded log
    assert [e.kind for e in result.events] == [
        k for k in kinds if k not in ("stall_begin", "stall_end", "run_result")
    ]
    # live: the first node's start was received before the run finished
    started_at = next(t for e, t in received if e.kind == "node_started")
    assert started_at < result.finished


async def test_app_stream_raises_the_failure_after_the_result_event():
    app = tc.App("stream_fail")

    @app.function()
    async def boom(ctx, inputs):
        raise ValueError("kaput")

    kinds = []
    with pytest.raises(tc.NodeFailed, match="kaput"):
        async with app.stream(llm=tc.ScriptedLLM("x")) as run:
            async for event in run:
                kinds.append(event.kind)
    assert kinds[-2:] == ["run_finished", "run_result"]
    assert run.result.status == "failed" and run.result.nodes["boom"].status == "failed"


async def test_leaving_the_stream_early_cancels_the_run_and_ends_its_stalls():
    app = _tool_app(tool_s=5.0)
    rec = tc.StallRecorder()
    t0 = time.perf_counter()
    async with app.stream(task="t", llm=tc.ScriptedLLM(["q", "a"]), stall=rec) as run:
        async for event in run:
            if event.kind == "stall_begin":
                break
    assert time.perf_counter() - t0 < 2.0
    assert run.result is not None and run.result.status == "cancelled"
    assert [(b.tool, e.outcome if e else None) for b, e in rec.pairs()] == [("search", "cancelled")]


async def test_stream_must_be_used_with_async_with():
    app = _tool_app()
    stream = app.stream(task="t", llm=tc.ScriptedLLM("x"))
    with pytest.raises(RuntimeError, match=r"async with app\.stream"):
        async for _ in stream:
            pass
