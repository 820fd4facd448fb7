"""Issue 13, point 3: the OpenAI Agents SDK adapter, driven by the real ``openai-agents`` runner
against a scripted OpenAI-compatible server (``tc.ScriptedLLM``), offline."""

import asyncio
import contextvars

import anyio
import pytest

agents = pytest.importorskip("agents")

from agents import Agent, Runner, function_tool, handoff  # noqa: E402

import tokencake as tc  # noqa: E402
from tokencake.events import GraphMeta, StallBegin  # noqa: E402
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


def _closed_pairs(rec: tc.StallRecorder) -> list[tuple[StallBegin, object]]:
    pairs = rec.pairs()
    for begin, end in pairs:
        assert end is not None, f"stall {begin.stall_id} ({begin.tool}) has no stall_end"
        assert (end.stall_id, end.session_id, end.tool) == (begin.stall_id, begin.session_id, begin.tool)
    assert len({b.stall_id for b, _ in pairs}) == len(pairs)
    assert len(rec.events) == 2 * len(pairs)  # exactly one begin and one end per stall
    return pairs


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

    pairs = _closed_pairs(rec)
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

    outcomes = {b.tool: (e.outcome, e.error) for b, e in _closed_pairs(rec)}
    assert outcomes["fatal"] == ("error", "RuntimeError: disk on fire")
    assert outcomes["slow"] == ("cancelled", None)  # the SDK cancels a tool past its timeout
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
    ((begin, end),) = _closed_pairs(rec)
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
    session = tc.Session("chat-handoff", events_url=False, hooks=rec)
    client = tc.openai_client(session, base_url=BASE_URL, transport=wire(llm))
    agent = tca.instrument(triage, session, model="m", client=client)

    result = await Runner.run(agent, "Where is order 42?")

    assert result.final_output == "Order 42 has shipped."
    assert result.last_agent.name == "billing" and result.last_agent is not billing
    assert [_meta(b)["session_id"] for b in llm.requests] == ["chat-handoff"] * 3
    assert [_meta(b)["turn"] for b in llm.requests] == [0, 1, 2]
    ((begin, end),) = _closed_pairs(rec)
    assert (begin.tool, begin.session_id, end.outcome) == ("lookup", "chat-handoff", "ok")
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
    pairs = _closed_pairs(rec)
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
