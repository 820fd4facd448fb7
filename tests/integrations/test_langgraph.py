"""Issue 13, point 3: the LangGraph / LangChain adapter, driven by real ``langchain.agents.create_agent``
and hand-built LangGraph graphs over ``ChatOpenAI`` against a scripted OpenAI-compatible server
(``tc.ScriptedLLM``), offline."""

import asyncio
import warnings

import anyio
import httpx
import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain.agents")
pytest.importorskip("langchain_openai")

from langchain.agents import create_agent
from langchain_core.tools import ToolException, tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import tokencake as tc
from tokencake.agents import _session as _session_mod
from tokencake.integrations.langgraph import TokenCakeMiddleware

pytestmark = pytest.mark.anyio
BASE_URL = "http://tokencake.test/v1"


def _meta(body: dict) -> dict:
    return body["kv_transfer_params"]["tokencake"]


def _prompt(body: dict) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


def _search_then_answer(req: tc.ScriptedRequest):
    """Call ``search`` for the prompt, then answer with what it returned."""
    if req.tool_results:
        return f"answer: {req.tool_results[-1]}"
    return tc.ToolCall(f"call-{req.index}", "search", {"q": req.prompt})


@tool
async def search(q: str) -> str:
    """Search the web."""
    await anyio.sleep(0.02)
    return f"hits for {q}"


def _model(llm: tc.ScriptedLLM, wire, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(
        model="m",
        base_url=BASE_URL,
        api_key="k",
        max_retries=0,
        http_async_client=httpx.AsyncClient(transport=wire(llm)),
        **kwargs,
    )


async def test_create_agent_keys_sessions_by_thread_and_agent(wire):
    rec = tc.StallRecorder()
    tk = TokenCakeMiddleware(events_url=False, hooks=rec, predicted_s={"search": 1.5}, kind="search")
    llm = tc.ScriptedLLM(_search_then_answer)
    agent = create_agent(
        _model(llm, wire, extra_body={"top_k": 5}),
        [search],
        middleware=[tk],
        name="researcher",
        checkpointer=InMemorySaver(),
    )

    async def ask(thread: str, question: str) -> str:
        config = {"configurable": {"thread_id": thread}}
        out = await agent.ainvoke({"messages": [{"role": "user", "content": question}]}, config)
        return out["messages"][-1].content

    async with anyio.create_task_group() as tg:  # two conversations at once
        tg.start_soon(ask, "t1", "t1: kv caches")
        tg.start_soon(ask, "t2", "t2: paged attention")
    assert await ask("t1", "t1: and offloading?") == "answer: hits for t1: and offloading?"

    s1, s2 = tk.sessions.get("t1", "researcher"), tk.sessions.get("t2", "researcher")
    assert s1.session_id != s2.session_id and len(tk.sessions) == 2
    by_thread = {"t1": s1.session_id, "t2": s2.session_id}
    for body in llm.requests:
        thread = _prompt(body)[:2]
        assert _meta(body)["session_id"] == by_thread[thread]  # model and tool node: one session
        assert _meta(body)["node"] == "researcher" and _meta(body)["run_id"].endswith(f":{thread}")
        assert body["priority"] == s1.request_metadata(advance=False)["priority"]
        assert body["top_k"] == 5  # the model's own extra_body is kept
    turns = [_meta(b)["turn"] for b in llm.requests if _prompt(b).startswith("t1")]
    assert turns == [0, 1, 2, 3]  # the second invoke continues the thread's session

    pairs = tc.testing.closed_pairs(rec)
    assert len(pairs) == 3  # one per tool call
    assert sorted(b.session_id for b, _ in pairs) == sorted([s1.session_id, s1.session_id, s2.session_id])
    assert {(b.tool, b.kind, b.predicted_s, e.outcome) for b, e in pairs} == {("search", "search", 1.5, "ok")}


async def test_hand_built_graph_sessions_follow_the_agent_not_the_node(wire):
    rec = tc.StallRecorder()
    tk = TokenCakeMiddleware(events_url=False, hooks=rec)
    llm = tc.ScriptedLLM({"researcher": _search_then_answer, "writer": _search_then_answer})
    model = ChatOpenAI(
        model="m",
        base_url=BASE_URL,
        api_key="k",
        http_async_client=httpx.AsyncClient(transport=tk.transport(wire(llm))),
    ).bind_tools([search])

    def react_agent():  # a ReAct loop: an LLM node and a ToolNode
        async def call_model(state: MessagesState) -> dict:
            return {"messages": [await model.ainvoke(state["messages"])]}

        graph = StateGraph(MessagesState)
        graph.add_node("llm", call_model)
        graph.add_node("tools", ToolNode([search], awrap_tool_call=tk.awrap_tool_call))
        graph.add_edge(START, "llm")
        graph.add_conditional_edges("llm", tools_condition)
        graph.add_edge("tools", "llm")
        return graph.compile()

    team = StateGraph(MessagesState)
    team.add_node("researcher", react_agent())
    team.add_node("writer", react_agent())
    team.add_edge(START, "researcher")
    team.add_edge("researcher", "writer")
    app = team.compile()
    await app.ainvoke(
        {"messages": [{"role": "user", "content": "report"}]}, {"configurable": {"thread_id": "t9"}}
    )

    researcher, writer = tk.sessions.get("t9", "researcher"), tk.sessions.get("t9", "writer")
    assert [(_meta(b)["session_id"], _meta(b)["turn"]) for b in llm.requests] == [
        (researcher.session_id, 0),
        (researcher.session_id, 1),
        (writer.session_id, 0),
        (writer.session_id, 1),
    ]
    assert researcher.run_id == writer.run_id  # one thread: the agents group together
    pairs = tc.testing.closed_pairs(rec)
    assert [(b.session_id, b.node, e.outcome) for b, e in pairs] == [
        (researcher.session_id, "researcher", "ok"),
        (writer.session_id, "writer", "ok"),
    ]


async def test_stall_ends_when_the_tool_fails_or_the_run_is_cancelled(wire):
    rec = tc.StallRecorder()
    tk = TokenCakeMiddleware("ops", events_url=False, hooks=rec)
    started = asyncio.Event()

    @tool
    async def deploy(target: str) -> str:
        """Deploy."""
        raise RuntimeError("cluster unreachable")

    @tool
    async def lint(path: str) -> str:
        """Lint."""
        raise ToolException("3 errors")

    lint.handle_tool_error = True  # the tool turns its error into an error message

    @tool
    async def wait_for_ci(build: str) -> str:
        """Waits."""
        started.set()
        await anyio.sleep(30)
        return "green"

    def script(req: tc.ScriptedRequest):
        if req.tool_results:
            return "done"
        name, args = {
            "lint": ("lint", {"path": "src"}),
            "deploy": ("deploy", {"target": "prod"}),
            "ci": ("wait_for_ci", {"build": "42"}),
        }[req.prompt]
        return tc.ToolCall(f"call-{req.index}", name, args)

    llm = tc.ScriptedLLM(script)
    agent = create_agent(_model(llm, wire), [deploy, lint, wait_for_ci], middleware=[tk])

    def run(prompt: str):
        return agent.ainvoke(
            {"messages": [{"role": "user", "content": prompt}]}, {"configurable": {"thread_id": prompt}}
        )

    assert (await run("lint"))["messages"][-1].content == "done"  # the error went back to the model
    with pytest.raises(RuntimeError, match="cluster unreachable"):
        await run("deploy")
    task = asyncio.create_task(run("ci"))
    with anyio.fail_after(5):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    outcomes = {b.tool: (e.outcome, e.error, b.session_id) for b, e in tc.testing.closed_pairs(rec)}
    assert outcomes == {
        "lint": ("error", "3 errors", tk.sessions.get("lint", "ops").session_id),
        "deploy": ("error", "RuntimeError: cluster unreachable", tk.sessions.get("deploy", "ops").session_id),
        "wait_for_ci": ("cancelled", None, tk.sessions.get("ci", "ops").session_id),
    }
    assert all(_meta(b)["node"] == "ops" for b in llm.requests)


def test_sync_invoke_gets_the_same_sessions_and_stalls(wire):
    rec = tc.StallRecorder()
    tk = TokenCakeMiddleware(events_url=False, hooks=rec)
    seen_open: list[int] = []

    @tool
    def grep(q: str) -> str:
        """A sync tool."""
        seen_open.append(len(rec.events))  # the begin is sent before the body runs
        return f"{q}: 2 matches"

    def script(req: tc.ScriptedRequest):
        return (
            f"answer: {req.tool_results[-1]}" if req.tool_results else tc.ToolCall("c1", "grep", {"q": "kv"})
        )

    llm = tc.ScriptedLLM(script)
    model = ChatOpenAI(
        model="m", base_url=BASE_URL, api_key="k", http_client=httpx.Client(transport=wire(llm))
    )
    agent = create_agent(model, [grep], middleware=[tk], name="coder")
    out = agent.invoke(
        {"messages": [{"role": "user", "content": "find kv"}]}, {"configurable": {"thread_id": "s1"}}
    )

    assert out["messages"][-1].content == "answer: kv: 2 matches"
    session = tk.sessions.get("s1", "coder")
    assert [(_meta(b)["session_id"], _meta(b)["turn"]) for b in llm.requests] == [
        (session.session_id, 0),
        (session.session_id, 1),
    ]
    ((begin, end),) = tc.testing.closed_pairs(rec)
    assert (begin.tool, begin.session_id, end.outcome) == ("grep", session.session_id, "ok")
    assert seen_open == [1]


async def test_models_without_extra_body_are_left_alone_and_say_so(wire):
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage

    class FakeToolModel(GenericFakeChatModel):
        def bind_tools(self, tools, **kwargs):
            return self

    rec = tc.StallRecorder()
    tk = TokenCakeMiddleware(events_url=False, hooks=rec)
    call = {"name": "search", "args": {"q": "x"}, "id": "c1", "type": "tool_call"}
    fake = FakeToolModel(messages=iter([AIMessage(content="", tool_calls=[call]), AIMessage(content="ok")]))
    agent = create_agent(fake, [search], middleware=[tk])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = await agent.ainvoke({"messages": [{"role": "user", "content": "q"}]})
    assert out["messages"][-1].content == "ok"
    assert [str(w.message) for w in caught if "extra_body" in str(w.message)] == [
        "FakeToolModel has no extra_body: its requests cannot carry TokenCake's session metadata "
        "(use ChatOpenAI against a TokenCake server)"
    ]
    ((begin, end),) = tc.testing.closed_pairs(rec)  # the tool calls are still bracketed
    assert end.outcome == "ok" and begin.session_id == tk.sessions.get(None, "agent").session_id


# ---------------------------------------------------------------------- failing loudly


async def test_sessions_follow_the_models_server(monkeypatch):
    for name in ("TOKENCAKE_BASE_URL", "TOKENCAKE_EVENTS_URL"):
        monkeypatch.delenv(name, raising=False)
    # An events listener answers on the model server's port + 1 (offline: none does, and a
    # session whose derived events URL has no listener sends no events: ``_events_probe``).
    monkeypatch.setattr(_session_mod, "missing_listener_sync", lambda url: None)
    server = tc.testing.ScriptedTransport("hello")  # no tool call: no stall event to deliver
    model = ChatOpenAI(
        model="m",
        base_url="http://127.0.0.1:18400/v1",
        api_key="k",
        http_async_client=server.http_async_client(),
    )
    tk = TokenCakeMiddleware()
    agent = create_agent(model, [search], middleware=[tk], name="r")
    await agent.ainvoke(
        {"messages": [{"role": "user", "content": "hi"}]}, {"configurable": {"thread_id": "t"}}
    )
    session = tk.sessions.get("t", "r")
    assert (session.base_url, session.events_url) == ("http://127.0.0.1:18400/v1", "http://127.0.0.1:18401")
    assert _meta(server.requests[0])["session_id"] == session.session_id


async def test_runs_without_a_thread_id_warn_that_they_share_a_session(wire):
    tk = TokenCakeMiddleware(events_url=False)
    llm = tc.ScriptedLLM("ok")
    agent = create_agent(_model(llm, wire), [search], middleware=[tk], name="r")
    with pytest.warns(RuntimeWarning, match=r"without configurable\.thread_id.*share one TokenCake session"):
        await agent.ainvoke({"messages": [{"role": "user", "content": "a"}]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per middleware
        await agent.ainvoke({"messages": [{"role": "user", "content": "b"}]})
    assert [_meta(b)["turn"] for b in llm.requests] == [0, 1]  # what the warning is about


async def test_a_tool_node_whose_model_sends_no_metadata_is_reported(wire):
    rec = tc.StallRecorder()
    tk = TokenCakeMiddleware(events_url=False, hooks=rec)
    llm = tc.ScriptedLLM([tc.ToolCall("c1", "search", {"q": "kv"}), "done"])
    model = _model(llm, wire).bind_tools([search])  # not through tk.transport()

    async def call_model(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("llm", call_model)
    graph.add_node("tools", ToolNode([search], awrap_tool_call=tk.awrap_tool_call))
    graph.add_edge(START, "llm")
    graph.add_conditional_edges("llm", tools_condition)
    graph.add_edge("tools", "llm")
    with pytest.warns(RuntimeWarning, match=r"carried no TokenCake metadata.*transport=tk\.transport\(\)"):
        await graph.compile().ainvoke(
            {"messages": [{"role": "user", "content": "q"}]}, {"configurable": {"thread_id": "t"}}
        )
    assert len(tc.testing.closed_pairs(rec)) == 1


# ---------------------------------------------------------------------- the server's decisions in the trace


async def test_kv_reports_are_custom_callback_events_of_the_resumed_turn():
    from langchain_core.callbacks import AsyncCallbackHandler

    class Events(AsyncCallbackHandler):
        def __init__(self) -> None:
            self.events: list[tuple[str, dict]] = []

        async def on_custom_event(self, name, data, **kwargs) -> None:
            self.events.append((name, data))

    def kv(req: tc.ScriptedRequest):
        return (
            tc.testing.kv_provenance(64, loaded_tokens=48)
            if req.tool_results
            else tc.testing.kv_provenance(20)
        )

    rec = tc.StallRecorder()
    tk = TokenCakeMiddleware(events_url=False, hooks=rec)
    server = tc.testing.ScriptedTransport(_search_then_answer, kv=kv)
    model = ChatOpenAI(
        model="m",
        base_url=server.base_url,
        api_key="k",
        http_async_client=httpx.AsyncClient(transport=tk.transport(server)),  # for the reports
    )
    agent = create_agent(model, [search], middleware=[tk], name="r", checkpointer=InMemorySaver())
    handler = Events()
    config = {"configurable": {"thread_id": "t"}, "callbacks": [handler]}
    await agent.ainvoke({"messages": [{"role": "user", "content": "q"}]}, config)

    session = tk.sessions.get("t", "r")
    # stamped once per request (by the middleware; the transport leaves stamped requests alone)
    assert [(_meta(b)["session_id"], _meta(b)["turn"]) for b in server.requests] == [
        (session.session_id, 0),
        (session.session_id, 1),
    ]
    ((begin, _end),) = tc.testing.closed_pairs(rec)
    ((name, report),) = handler.events
    assert name == "tokencake_kv"
    assert (
        report["tool"] == "search"
        and report["tool_call_id"] == "call-0"
        and report["stall_id"] == begin.stall_id
    )
    assert (report["decision"], report["offloaded"], report["loaded_tokens"], report["kept_tokens"]) == (
        "loaded",
        True,
        48,
        0,
    )
    assert report["session_id"] == session.session_id and report["prompt_tokens"] == 64


def test_sync_runs_dispatch_kv_reports_too():
    from langchain_core.callbacks import BaseCallbackHandler

    class Events(BaseCallbackHandler):
        def __init__(self) -> None:
            self.events: list[tuple[str, dict]] = []

        def on_custom_event(self, name, data, **kwargs) -> None:
            self.events.append((name, data))

    @tool
    def grep(q: str) -> str:
        """A sync tool."""
        return f"{q}: 2 matches"

    def script(req: tc.ScriptedRequest):
        return "found" if req.tool_results else tc.ToolCall("c1", "grep", {"q": "kv"})

    tk = TokenCakeMiddleware(events_url=False, hooks=(rec := tc.StallRecorder()))
    server = tc.testing.ScriptedTransport(script, kv=tc.testing.kv_provenance(30, prefetched_tokens=16))
    model = ChatOpenAI(
        model="m",
        base_url=server.base_url,
        api_key="k",
        http_client=httpx.Client(transport=tk.transport(server)),
    )
    agent = create_agent(model, [grep], middleware=[tk], name="coder")
    handler = Events()
    agent.invoke(
        {"messages": [{"role": "user", "content": "find kv"}]},
        {"configurable": {"thread_id": "s1"}, "callbacks": [handler]},
    )
    ((begin, _end),) = tc.testing.closed_pairs(rec)
    ((name, report),) = handler.events
    assert (name, report["stall_id"], report["decision"], report["prefetched_tokens"]) == (
        "tokencake_kv",
        begin.stall_id,
        "prefetched",
        16,
    )
