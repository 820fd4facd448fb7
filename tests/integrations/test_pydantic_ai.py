"""Issue 13, point 3: the Pydantic AI adapter, driven by a real ``pydantic_ai.Agent`` with its OpenAI
chat model against a scripted OpenAI-compatible server (``tc.ScriptedLLM``), offline."""

import asyncio

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
from tokencake.events import GraphMeta
from tokencake.integrations.pydantic_ai import TokenCake, TokenCakeToolset

pytestmark = pytest.mark.anyio
BASE_URL = "http://tokencake.test/v1"


def _meta(body: dict) -> dict:
    return body["kv_transfer_params"]["tokencake"]


def _closed_pairs(rec: tc.StallRecorder) -> list:
    pairs = rec.pairs()
    for begin, end in pairs:
        assert end is not None, f"stall {begin.stall_id} ({begin.tool}) has no stall_end"
        assert (end.stall_id, end.session_id, end.tool) == (begin.stall_id, begin.session_id, begin.tool)
    assert len({b.stall_id for b, _ in pairs}) == len(pairs)
    assert len(rec.events) == 2 * len(pairs)
    return pairs


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

    pairs = _closed_pairs(rec)
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

    outcomes = [(b.tool, e.outcome, e.error) for b, e in _closed_pairs(rec)]
    assert outcomes == [
        ("fetch", "error", "ModelRetry: try https"),
        ("fetch", "ok", None),
        ("deploy", "error", "RuntimeError: cluster unreachable"),
        ("wait_for_ci", "cancelled", None),
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

    llm = tc.ScriptedLLM([tc.ToolCall("c1", "add", {"a": 2, "b": 3}), "5"])
    toolset = TokenCakeToolset(FunctionToolset([add]), session=lambda ctx: session, predicted_s=0.1)
    agent = Agent(_model(llm, wire), toolsets=[toolset])
    assert (await agent.run("2+3?")).output == "5"
    ((begin, end),) = _closed_pairs(rec)
    assert (begin.session_id, begin.tool, begin.predicted_s, end.outcome) == ("chat-7", "add", 0.1, "ok")
