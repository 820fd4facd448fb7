"""Issue 13, point 3: the Pydantic AI adapter, driven by a real ``pydantic_ai.Agent`` with its OpenAI
chat model against a scripted OpenAI-compatible server (``tc.ScriptedLLM``), offline."""

import asyncio
import warnings

import anyio
import httpx
import openai
import pytest

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent, ModelRetry
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.toolsets import FunctionToolset

import tokencake as tc
from tokencake.agents import _session as _session_mod
from tokencake.events import GraphMeta
from tokencake.integrations.pydantic_ai import TokenCake, TokenCakeToolset

pytestmark = pytest.mark.anyio
BASE_URL = "http://tokencake.test/v1"


def _meta(body: dict) -> dict:
    return body["kv_transfer_params"]["tokencake"]


def _model(llm: tc.ScriptedLLM, wire, **settings) -> OpenAIChatModel:
    client = openai.AsyncOpenAI(
        base_url=BASE_URL, api_key="k", max_retries=0, http_client=httpx.AsyncClient(transport=wire(llm))
    )
    return OpenAIChatModel("m", provider=OpenAIProvider(openai_client=client), settings=settings or None)


async def test_every_request_and_tool_call_belong_to_the_conversation(wire):
    rec = tc.StallRecorder()
    open_at_body: list[int] = []

    async def search(q: str) -> str:
        """Search the web."""
        open_at_body.append(sum(1 if e.type == "stall_begin" else -1 for e in rec.events))
        await anyio.sleep(0.02)
        return f"hits for {q}"

    def clock() -> str:
        """The time (a sync tool: run in a thread)."""
        return "noon"

    def script(req: tc.ScriptedRequest):
        if req.tool_results:
            return f"answer {req.index}"
        if req.prompt == "first":
            return [tc.ToolCall("c1", "search", {"q": "kv"}), tc.ToolCall("c2", "clock", {})]
        return tc.ToolCall(f"c{req.index}", "search", {"q": req.prompt})

    llm = tc.ScriptedLLM(script)
    tk = TokenCake(events_url=False, hooks=rec, predicted_s={"search": 2.0}, kind={"search": "search"})
    agent = Agent(
        _model(llm, wire, extra_body={"top_k": 5}), name="helper", tools=[search, clock], capabilities=[tk]
    )

    first = await agent.run("first")
    second = await agent.run("second", message_history=first.all_messages())  # the same conversation
    async with agent.run_stream("other") as streamed:  # a new conversation, streamed
        assert await streamed.get_output() == "answer 5"
        other_conversation = streamed.conversation_id

    assert second.conversation_id == first.conversation_id != other_conversation
    one = tk.sessions.get(first.conversation_id, "helper")
    other = tk.sessions.get(other_conversation, "helper")
    assert len(tk.sessions) == 2
    sessions = [_meta(b)["session_id"] for b in llm.requests]
    assert sessions == [one.session_id] * 4 + [other.session_id] * 2
    assert [_meta(b)["turn"] for b in llm.requests] == [0, 1, 2, 3, 0, 1]
    assert {_meta(b)["node"] for b in llm.requests} == {"helper"}
    assert {b["priority"] for b in llm.requests} == {0}
    assert {b["top_k"] for b in llm.requests} == {5}  # the model's own extra_body is kept
    assert [bool(b.get("stream")) for b in llm.requests] == [False] * 4 + [True] * 2

    pairs = tc.testing.closed_pairs(rec)
    assert sorted(b.tool for b, _ in pairs) == ["clock", "search", "search", "search"]
    assert sorted(b.session_id for b, _ in pairs) == sorted([one.session_id] * 3 + [other.session_id])
    assert {(b.tool, b.kind, b.predicted_s) for b, _ in pairs} == {
        ("search", "search", 2.0),
        ("clock", "tool", None),
    }
    assert {e.outcome for _, e in pairs} == {"ok"}
    assert min(open_at_body) >= 1  # every search ran inside its stall


async def test_the_capability_options_reach_every_request(wire):
    llm = tc.ScriptedLLM("hello")
    slack = GraphMeta(on_critical_path=False, slack_s=7.0)
    tk = TokenCake("writer", events_url=False, importance=2.0, next_stall="web_search", namespace="app")
    tk.sessions.get("c-1", "writer").graph = slack  # sessions are plain tc.Session objects
    agent = Agent(_model(llm, wire), capabilities=[tk])
    result = await agent.run("hi", conversation_id="c-1")
    (body,) = llm.requests
    expected = tc.request_metadata(
        "app:c-1:writer",
        run_id="app:c-1",
        node="writer",
        importance=2.0,
        graph=slack,
        next_stall="web_search",
        stall_events=False,  # events_url=False: the server derives the stalls from the requests
    )
    assert result.conversation_id == "c-1"
    assert body["priority"] == expected["priority"] > 0
    assert _meta(body) == expected["kv_transfer_params"]["tokencake"]


async def test_stall_ends_on_retry_error_and_cancellation(wire):
    rec = tc.StallRecorder()
    started = asyncio.Event()
    attempts: list[int] = []

    async def fetch(url: str) -> str:
        """Fetch a page; the first attempt asks the model to retry."""
        attempts.append(1)
        if len(attempts) == 1:
            raise ModelRetry("try https")
        return "page"

    async def deploy(target: str) -> str:
        """Deploy."""
        raise RuntimeError("cluster unreachable")

    async def wait_for_ci(build: str) -> str:
        """Waits."""
        started.set()
        await anyio.sleep(30)
        return "green"

    def script(req: tc.ScriptedRequest):
        if req.tool_results and "try https" not in req.tool_results[-1]:
            return "done"
        name, args = {"fetch": ("fetch", {"url": "u"}), "deploy": ("deploy", {"target": "t"})}.get(
            req.prompt, ("wait_for_ci", {"build": "b"})
        )
        return tc.ToolCall(f"c{req.index}", name, args)

    llm = tc.ScriptedLLM(script)
    tk = TokenCake("ops", events_url=False, hooks=rec)
    agent = Agent(_model(llm, wire), tools=[fetch, deploy, wait_for_ci], capabilities=[tk])

    assert (await agent.run("fetch")).output == "done"
    with pytest.raises(RuntimeError, match="cluster unreachable"):
        await agent.run("deploy")
    task = asyncio.create_task(agent.run("ci"))
    with anyio.fail_after(5):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    outcomes = [(b.tool, b.attempt, e.outcome, e.error) for b, e in tc.testing.closed_pairs(rec)]
    assert outcomes == [
        ("fetch", 1, "error", "ModelRetry: try https"),
        ("fetch", 2, "ok", None),  # the retry the model made after ModelRetry
        ("deploy", 1, "error", "RuntimeError: cluster unreachable"),
        ("wait_for_ci", 1, "cancelled", None),
    ]
    assert all(_meta(b)["node"] == "ops" for b in llm.requests)


async def test_the_wrapper_toolset_works_on_its_own(wire):
    rec = tc.StallRecorder()
    session = tc.Session(
        "chat-7", events_url=False, hooks=rec, graph=GraphMeta(on_critical_path=False, slack_s=3)
    )

    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    server = tc.testing.ScriptedTransport([tc.ToolCall("c1", "add", {"a": 2, "b": 3}), "5"])
    toolset = TokenCakeToolset(FunctionToolset([add]), session=lambda ctx: session, predicted_s=0.1)
    model = OpenAIChatModel("m", provider=OpenAIProvider(openai_client=server.openai_client(session)))
    agent = Agent(model, toolsets=[toolset])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its requests carry the session: nothing to report
        assert (await agent.run("2+3?")).output == "5"
    ((begin, end),) = tc.testing.closed_pairs(rec)
    assert (begin.session_id, begin.tool, begin.predicted_s, end.outcome) == ("chat-7", "add", 0.1, "ok")
    assert [_meta(b)["session_id"] for b in server.requests] == ["chat-7"] * 2


async def test_the_wrapper_toolset_alone_says_when_the_requests_carry_no_metadata(wire):
    rec = tc.StallRecorder()
    session = tc.Session("chat-8", events_url=False, hooks=rec)

    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    llm = tc.ScriptedLLM(
        [tc.ToolCall("c1", "add", {"a": 2, "b": 3}), "5", tc.ToolCall("c2", "add", {"a": 1, "b": 1}), "2"]
    )
    toolset = TokenCakeToolset(FunctionToolset([add]), session=lambda ctx: session)
    agent = Agent(_model(llm, wire), toolsets=[toolset])  # a plain client: the stalls match no KV
    with pytest.warns(RuntimeWarning) as caught:
        await agent.run("2+3?")
        await agent.run("1+1?")
    assert [str(w.message) for w in caught if "TokenCake" in str(w.message)] == [
        "a tool call of session 'chat-8', whose model requests carried no TokenCake metadata: the server "
        "cannot match its stall to any KV cache. Add the TokenCake capability (Agent(..., "
        "capabilities=[TokenCake()])), which stamps the requests, or give the model's client "
        "tc.TokenCakeTransport(session)."
    ]
    assert len(tc.testing.closed_pairs(rec)) == 2


async def test_sessions_follow_the_models_server(monkeypatch):
    for name in ("TOKENCAKE_BASE_URL", "TOKENCAKE_EVENTS_URL"):
        monkeypatch.delenv(name, raising=False)
    # An events listener answers on the model server's port + 1 (offline: none does, and a
    # session whose derived events URL has no listener sends no events: ``_events_probe``).
    monkeypatch.setattr(_session_mod, "missing_listener_sync", lambda url: None)
    server = tc.testing.ScriptedTransport("hello")  # no tool call: no stall event to deliver
    client = openai.AsyncOpenAI(
        base_url="http://127.0.0.1:18400/v1", api_key="k", http_client=server.http_async_client()
    )
    tk = TokenCake()
    agent = Agent(
        OpenAIChatModel("m", provider=OpenAIProvider(openai_client=client)), name="r", capabilities=[tk]
    )
    result = await agent.run("hi", conversation_id="c")
    session = tk.sessions.get(result.conversation_id, "r")
    assert (session.base_url, session.events_url) == ("http://127.0.0.1:18400/v1", "http://127.0.0.1:18401")


async def test_each_tool_calls_kv_report_is_a_span_under_the_tool_call():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from pydantic_ai.capabilities.instrumentation import Instrumentation
    from pydantic_ai.models.instrumented import InstrumentationSettings

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def search(q: str) -> str:
        """Search."""
        return f"hits for {q}"

    def kv(req: tc.ScriptedRequest):
        return (
            tc.testing.kv_provenance(90, kept_tokens=64) if req.tool_results else tc.testing.kv_provenance(30)
        )

    server = tc.testing.ScriptedTransport(
        lambda req: "done" if req.tool_results else tc.ToolCall("c1", "search", {"q": "kv"}), kv=kv
    )
    rec = tc.StallRecorder()
    tk = TokenCake(events_url=False, hooks=rec)
    model = OpenAIChatModel("m", provider=OpenAIProvider(openai_client=server.openai_client()))
    agent = Agent(
        model,
        name="r",
        tools=[search],
        capabilities=[Instrumentation(settings=InstrumentationSettings(tracer_provider=provider)), tk],
    )
    result = await agent.run("search kv")

    spans = exporter.get_finished_spans()
    (kv_span,) = [s for s in spans if s.name == "tokencake.kv"]
    (tool_span,) = [s for s in spans if s.attributes.get("gen_ai.tool.name") == "search"]
    assert kv_span.parent.span_id == tool_span.context.span_id  # under the tool call it describes
    ((begin, _end),) = tc.testing.closed_pairs(rec)
    attributes = dict(kv_span.attributes)
    assert attributes == {
        "tokencake.kv.tool": "search",
        "tokencake.kv.tool_call_id": "c1",
        "tokencake.kv.stall_id": begin.stall_id,
        "tokencake.kv.session_id": tk.sessions.get(result.conversation_id, "r").session_id,
        "tokencake.kv.decision": "kept",
        "tokencake.kv.offloaded": False,
        "tokencake.kv.kept_tokens": 64,
        "tokencake.kv.loaded_tokens": 0,
        "tokencake.kv.prompt_tokens": 90,
        "tokencake.kv.prefetched_tokens": 0,
        "tokencake.kv.admissions": 1,
        "tokencake.kv.failed_copy_tokens": 0,
        "tokencake.kv.failed_load_tokens": 0,
        "tokencake.kv.recomputed_tokens": 0,
    }
    # the capability read the provenance without leaving vendor fields in the message history
    assert all(
        not (m.provider_details or {}).get("unmapped")
        for m in result.all_messages()
        if hasattr(m, "provider_details")
    )
