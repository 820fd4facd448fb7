"""Issue 13, point 3: the OpenAI Agents SDK adapter, driven by the real ``openai-agents`` runner
against a scripted OpenAI-compatible server (``tc.ScriptedLLM``), offline."""

import asyncio
import contextvars
import warnings

import anyio
import pytest

agents = pytest.importorskip("agents")

import openai  # noqa: E402
from agents import Agent, Runner, function_tool, handoff  # noqa: E402

import tokencake as tc  # noqa: E402
from tokencake.events import GraphMeta  # noqa: E402
from tokencake.integrations import openai_agents as tca  # noqa: E402

pytestmark = pytest.mark.anyio
BASE_URL = "http://tokencake.test/v1"


@pytest.fixture(autouse=True)
def _no_tracing():
    agents.set_tracing_disabled(True)  # the SDK would export traces to api.openai.com
    yield
    agents.set_tracing_disabled(False)


def _meta(body: dict) -> dict:
    return body["kv_transfer_params"]["tokencake"]


async def _until_ended(rec: tc.StallRecorder, count: int) -> None:
    # A cancelled tool task ends on the loop after the runner has returned.
    with anyio.fail_after(5):
        while sum(1 for _, end in rec.pairs() if end is not None) < count:
            await anyio.sleep(0.01)


async def test_every_request_carries_the_session_and_every_tool_call_one_stall(wire):
    rec = tc.StallRecorder()
    open_at_body: list[list[str]] = []

    @function_tool
    async def get_weather(city: str) -> str:
        """The weather in a city."""
        ended = {e.stall_id for e in rec.events if e.type == "stall_end"}
        open_at_body.append(
            [e.tool for e in rec.events if e.type == "stall_begin" and e.stall_id not in ended]
        )
        return f"sunny in {city}"

    @function_tool
    def local_time(city: str) -> str:
        """The local time in a city (a sync tool: the SDK runs it in a thread)."""
        return "noon"

    llm = tc.ScriptedLLM(
        [
            [
                tc.ToolCall("c1", "get_weather", {"city": "Paris"}),
                tc.ToolCall("c2", "local_time", {"city": "Paris"}),
            ],
            "Sunny, noon.",
            tc.ToolCall("c3", "get_weather", {"city": "Rome"}),
            "Sunny too.",
        ]
    )
    slack = GraphMeta(on_critical_path=False, slack_s=12.0)
    session = tc.Session("chat-42", node="weather_agent", graph=slack, events_url=False, hooks=rec)
    original = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather, local_time])
    agent = tca.instrument(
        original,
        session,
        model="smollm2",
        client=tc.openai_client(session, base_url=BASE_URL, transport=wire(llm)),
        predicted_s={"get_weather": 2.0},
        kind={"get_weather": "search"},
    )

    first = await Runner.run(agent, "Weather and time in Paris?")
    second = await Runner.run(agent, [*first.to_input_list(), {"role": "user", "content": "And Rome?"}])

    assert (first.final_output, second.final_output) == ("Sunny, noon.", "Sunny too.")
    assert len(llm.requests) == 4
    assert [_meta(b)["session_id"] for b in llm.requests] == ["chat-42"] * 4
    assert [_meta(b)["turn"] for b in llm.requests] == [0, 1, 2, 3]  # one conversation across runs
    assert {_meta(b)["node"] for b in llm.requests} == {"weather_agent"}
    assert {b["priority"] for b in llm.requests} == {12}  # the session's priority, on every request
    assert {b["model"] for b in llm.requests} == {"smollm2"}
    assert {t["function"]["name"] for t in llm.requests[0]["tools"]} == {"get_weather", "local_time"}

    pairs = tc.testing.closed_pairs(rec)
    assert sorted(b.tool for b, _ in pairs) == ["get_weather", "get_weather", "local_time"]
    assert {b.session_id for b, _ in pairs} == {"chat-42"}
    assert {e.outcome for _, e in pairs} == {"ok"}
    hints = {(b.tool, b.kind, b.predicted_s) for b, _ in pairs}
    assert hints == {("get_weather", "search", 2.0), ("local_time", "tool", None)}
    assert all("get_weather" in open_tools for open_tools in open_at_body)  # begin precedes the body
    # the original agent and its tools are untouched
    assert original.model is None and original.tools[0] is get_weather
    assert get_weather.on_invoke_tool is not agent.tools[0].on_invoke_tool


async def test_stall_ends_when_the_tool_raises_or_times_out(wire):
    rec = tc.StallRecorder()

    @function_tool  # default failure handler: the model sees the error, the run goes on
    async def flaky(q: str) -> str:
        """Fails."""
        raise ValueError("backend down")

    @function_tool(timeout=0.05)
    async def slow(q: str) -> str:
        """Too slow."""
        await anyio.sleep(5)
        return "late"

    @function_tool(failure_error_function=None)  # the error propagates and fails the run
    async def fatal(q: str) -> str:
        """Fails hard."""
        raise RuntimeError("disk on fire")

    llm = tc.ScriptedLLM(
        [
            [tc.ToolCall("c1", "flaky", {"q": "x"}), tc.ToolCall("c2", "slow", {"q": "x"})],
            tc.ToolCall("c3", "fatal", {"q": "x"}),
        ]
    )
    session = tc.Session("chat-err", events_url=False, hooks=rec)
    client = tc.openai_client(session, base_url=BASE_URL, transport=wire(llm))
    agent = tca.instrument(Agent(name="a", tools=[flaky, slow, fatal]), session, model="m", client=client)

    with pytest.raises(Exception, match="disk on fire"):
        await Runner.run(agent, "go")

    outcomes = {b.tool: (e.outcome, e.error) for b, e in tc.testing.closed_pairs(rec)}
    assert outcomes["fatal"] == ("error", "RuntimeError: disk on fire")
    # the SDK cancels a tool past its timeout: that is a timeout, not a cancellation
    assert outcomes["slow"] == ("timeout", "ToolTimeoutError: slow timed out after 0.05 s")
    # the SDK turned this error into a message for the model inside the tool's invoker
    assert outcomes["flaky"] == ("ok", None)
    flaky_reply = [m for m in llm.requests[1]["messages"] if m.get("tool_call_id") == "c1"]
    assert "error" in flaky_reply[0]["content"]
    assert [_meta(b)["session_id"] for b in llm.requests] == ["chat-err"] * 2


async def test_stall_ends_when_the_run_is_cancelled(wire):
    rec = tc.StallRecorder()
    started = asyncio.Event()

    @function_tool
    async def crawl(url: str) -> str:
        """Takes long."""
        started.set()
        await anyio.sleep(30)
        return "page"

    llm = tc.ScriptedLLM([tc.ToolCall("c1", "crawl", {"url": "u"})])
    session = tc.Session("chat-cancel", events_url=False, hooks=rec)
    client = tc.openai_client(session, base_url=BASE_URL, transport=wire(llm))
    agent = tca.instrument(Agent(name="a", tools=[crawl]), session, model="m", client=client)

    run = asyncio.create_task(Runner.run(agent, "crawl it"))
    with anyio.fail_after(5):
        await started.wait()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    await _until_ended(rec, 1)
    ((begin, end),) = tc.testing.closed_pairs(rec)
    assert (begin.tool, end.outcome, end.session_id) == ("crawl", "cancelled", "chat-cancel")


async def test_handoffs_continue_the_conversation_session(wire):
    rec = tc.StallRecorder()

    @function_tool
    async def lookup(order: str) -> str:
        """Find an order."""
        return "shipped"

    billing = Agent(name="billing", tools=[lookup])
    triage = Agent(name="triage", handoffs=[handoff(billing)])
    billing.handoffs = [triage]  # agents may hand back: instrument copes with the cycle
    llm = tc.ScriptedLLM(
        [
            tc.ToolCall("h1", "transfer_to_billing", {}),
            tc.ToolCall("c1", "lookup", {"order": "42"}),
            "Order 42 has shipped.",
        ]
    )
    session = tc.Session("chat-handoff", node="triage", events_url=False, hooks=rec)
    client = tc.openai_client(session, base_url=BASE_URL, transport=wire(llm))
    agent = tca.instrument(triage, session, model="m", client=client)

    result = await Runner.run(agent, "Where is order 42?")

    assert result.final_output == "Order 42 has shipped."
    assert result.last_agent.name == "billing" and result.last_agent is not billing
    assert [_meta(b)["session_id"] for b in llm.requests] == ["chat-handoff"] * 3
    assert [_meta(b)["turn"] for b in llm.requests] == [0, 1, 2]
    ((begin, end),) = tc.testing.closed_pairs(rec)
    assert (begin.tool, begin.session_id, end.outcome) == ("lookup", "chat-handoff", "ok")
    # the tool is billing's: the server learns its duration under billing, not under triage
    assert (begin.node, begin.agent_type, end.node) == ("billing", "billing", "billing")
    assert triage.model is None and billing.tools[0] is lookup


async def test_one_shared_agent_serves_concurrent_conversations(wire):
    rec = tc.StallRecorder()
    current: contextvars.ContextVar[tc.Session | None] = contextvars.ContextVar("session", default=None)

    @function_tool
    async def search(q: str) -> str:
        """Search."""
        await anyio.sleep(0.05)  # both conversations wait at the same time
        return f"hits for {q}"

    def script(req: tc.ScriptedRequest):
        if req.tool_results:
            return f"done: {req.tool_results[0]}"
        return tc.ToolCall(f"call-{req.node}", "search", {"q": req.node})

    llm = tc.ScriptedLLM(script)
    client = tc.openai_client(current.get, base_url=BASE_URL, transport=wire(llm))
    agent = tca.instrument(Agent(name="researcher", tools=[search]), current.get, model="m", client=client)
    outputs: dict[str, str] = {}

    async def converse(session: tc.Session) -> None:
        current.set(session)
        outputs[session.session_id] = (await Runner.run(agent, "research")).final_output

    sessions = [tc.Session(f"conv-{n}", node=n, events_url=False, hooks=rec) for n in ("a", "b")]
    async with anyio.create_task_group() as tg:
        for session in sessions:
            tg.start_soon(converse, session)

    assert outputs == {"conv-a": "done: hits for a", "conv-b": "done: hits for b"}
    by_session: dict[str, list[str]] = {}
    for body in llm.requests:
        by_session.setdefault(_meta(body)["session_id"], []).append(_meta(body)["node"])
    assert by_session == {"conv-a": ["a", "a"], "conv-b": ["b", "b"]}
    pairs = tc.testing.closed_pairs(rec)
    assert sorted(b.session_id for b, _ in pairs) == ["conv-a", "conv-b"]
    starts = sorted(b.ts for b, _ in pairs)
    assert starts[1] < min(e.ts for _, e in pairs)  # the two stalls overlap


async def test_instrument_rejects_what_it_cannot_serve(monkeypatch):
    monkeypatch.delenv("TOKENCAKE_MODEL", raising=False)
    session = tc.Session("s", events_url=False)
    with pytest.raises(ValueError, match="TOKENCAKE_MODEL"):
        tca.instrument(Agent(name="nameless"), session)
    with pytest.raises(TypeError, match=r"tc\.Session"):
        tca.instrument(Agent(name="a", model="m"), "chat-1")
    monkeypatch.setenv("TOKENCAKE_MODEL", "served")
    agent = tca.instrument(Agent(name="a"), session, base_url=BASE_URL)
    assert agent.model.model == "served"


# ---------------------------------------------------------------------- failing loudly


def test_stall_events_follow_the_adapters_server(monkeypatch):
    for name in ("TOKENCAKE_BASE_URL", "TOKENCAKE_EVENTS_URL"):
        monkeypatch.delenv(name, raising=False)
    agent = Agent(name="a", model="m")
    session = tc.Session("s-url")  # no server named: the adapter's is the one
    tca.instrument(agent, session, base_url="http://127.0.0.1:18400/v1")
    assert (session.base_url, session.events_url) == ("http://127.0.0.1:18400/v1", "http://127.0.0.1:18401")

    other = tc.Session("s-client")  # or the client's
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:18500/v1", api_key="k")
    tca.instrument(agent, other, client=client)
    assert other.events_url == "http://127.0.0.1:18501"

    named = tc.Session("s-named", base_url="http://127.0.0.1:8000/v1")  # named twice, differently
    with pytest.warns(RuntimeWarning, match="chat completions go to http://127.0.0.1:18400/v1 but stall"):
        tca.instrument(agent, named, base_url="http://127.0.0.1:18400/v1")
    assert named.events_url == "http://127.0.0.1:8001"


async def test_a_client_that_does_not_stamp_requests_is_reported_once():
    rec = tc.StallRecorder()

    @function_tool
    async def lookup(order: str) -> str:
        """Find an order."""
        return "shipped"

    server = tc.testing.ScriptedTransport(
        [
            tc.ToolCall("c1", "lookup", {"order": "1"}),
            "done",
            tc.ToolCall("c2", "lookup", {"order": "2"}),
            "ok",
        ]
    )
    session = tc.Session("chat-plain", events_url=False, hooks=rec)
    agent = tca.instrument(Agent(name="a", tools=[lookup]), session, model="m", client=server.openai_client())
    with pytest.warns(RuntimeWarning) as caught:
        await Runner.run(agent, "where is order 1?")
        await Runner.run(agent, "and order 2?")
    messages = [str(w.message) for w in caught if "TokenCake" in str(w.message)]
    assert messages == [
        "instrument(): the requests of session 'chat-plain' carry no TokenCake metadata (its client does not "
        "stamp them). Leave instrument()'s client= out (it builds tc.openai_client(session)), or build that "
        "client with tc.openai_client(session, base_url=..., api_key=...)."
    ]
    assert all("kv_transfer_params" not in body for body in server.requests)
    assert len(tc.testing.closed_pairs(rec)) == 2  # the tools are still bracketed


async def test_a_run_config_model_that_does_not_stamp_requests_is_reported():
    from agents import OpenAIChatCompletionsModel, RunConfig

    @function_tool
    async def lookup(order: str) -> str:
        """Find an order."""
        return "shipped"

    server = tc.testing.ScriptedTransport([tc.ToolCall("c1", "lookup", {"order": "1"}), "done"])
    session = tc.Session("chat-rc", events_url=False, hooks=tc.StallRecorder())
    agent = tca.instrument(
        Agent(name="a", tools=[lookup]), session, model="m", client=server.openai_client(session)
    )
    plain = OpenAIChatCompletionsModel(model="m", openai_client=server.openai_client())
    with pytest.warns(
        RuntimeWarning, match=r"carried no TokenCake metadata.*RunConfig\(model=\.\.\.\) replaces"
    ):
        await Runner.run(agent, "where is order 1?", run_config=RunConfig(model=plain))
    assert session.turn == 0 and all("kv_transfer_params" not in body for body in server.requests)


# ---------------------------------------------------------------------- the server's decisions in the trace


class _Spans:
    """A trace processor keeping every finished span (instead of exporting it)."""

    def __init__(self) -> None:
        self.spans: list = []

    def on_trace_start(self, trace) -> None: ...

    def on_trace_end(self, trace) -> None: ...

    def on_span_start(self, span) -> None: ...

    def on_span_end(self, span) -> None:
        self.spans.append(span)

    def shutdown(self) -> None: ...

    def force_flush(self) -> None: ...


async def test_each_tool_calls_kv_report_is_a_span_under_the_tool_call():
    spans = _Spans()
    agents.set_trace_processors([spans])
    agents.set_tracing_disabled(False)

    @function_tool
    async def search(q: str) -> str:
        """Search."""
        return f"hits for {q}"

    def kv(req: tc.ScriptedRequest):  # what the server did with each request's prompt KV
        if req.index == 0:
            return tc.testing.kv_provenance(40)  # the first turn: computed
        return tc.testing.kv_provenance(req.index * 100, kept_tokens=16, prefetched_tokens=32)

    server = tc.testing.ScriptedTransport(
        [[tc.ToolCall("c1", "search", {"q": "a"}), tc.ToolCall("c2", "search", {"q": "b"})], "done"], kv=kv
    )
    session = tc.Session("chat-kv", events_url=False, hooks=(rec := tc.StallRecorder()))
    agent = tca.instrument(
        Agent(name="a", tools=[search]), session, model="m", client=server.openai_client(session)
    )
    try:
        assert (await Runner.run(agent, "search")).final_output == "done"
    finally:
        agents.set_tracing_disabled(True)
        agents.set_trace_processors([])

    function_spans = [s for s in spans.spans if s.span_data.type == "function"]
    kv_spans = [s for s in spans.spans if s.span_data.type == "custom" and s.span_data.name == "tokencake.kv"]
    assert len(function_spans) == 2 and len(kv_spans) == 2
    stalls = {b.stall_id for b, _ in tc.testing.closed_pairs(rec)}
    assert {s.span_data.data["tool_call_id"] for s in kv_spans} == {"c1", "c2"}
    for span in kv_spans:
        data = span.span_data.data
        assert data["stall_id"] in stalls and (data["tool"], data["session_id"]) == ("search", "chat-kv")
        assert (data["decision"], data["offloaded"], data["prompt_tokens"]) == ("prefetched", True, 100)
        assert (data["kept_tokens"], data["prefetched_tokens"], data["loaded_tokens"]) == (16, 32, 0)
        assert data["recomputed_tokens"] == 0  # the first turn (its prompt and reply) was all found
    # each report hangs under its own tool call's span
    assert {s.parent_id for s in kv_spans} == {s.span_id for s in function_spans}


async def test_streamed_runs_are_stamped_and_bracketed_too():
    rec = tc.StallRecorder()

    @function_tool
    async def search(q: str) -> str:
        """Search."""
        return f"hits for {q}"

    server = tc.testing.ScriptedTransport(
        [tc.ToolCall("c1", "search", {"q": "kv"}), "done"], kv=tc.testing.kv_provenance(9)
    )
    session = tc.Session("chat-stream", events_url=False, hooks=rec)
    agent = tca.instrument(
        Agent(name="a", tools=[search]), session, model="m", client=server.openai_client(session)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stamped: nothing to report
        result = Runner.run_streamed(agent, "search")
        async for _event in result.stream_events():
            pass
    assert result.final_output == "done"
    assert [(b["stream"], _meta(b)["turn"]) for b in server.requests] == [(True, 0), (True, 1)]
    ((begin, end),) = tc.testing.closed_pairs(rec)
    assert (begin.tool, end.outcome) == ("search", "ok")
