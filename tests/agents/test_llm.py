import json

import httpx
import pytest

import tokencake as tc
from tokencake.events import RequestMeta, priority_from_graph

pytestmark = pytest.mark.anyio


def _two_branch_app() -> tc.App:
    """planner -> (searcher [critical], note [slack]) -> writer."""
    app = tc.App("meta", inputs=["task"])

    @app.tool(predict_time=4.0, kind="search")
    def web_search(query: str) -> str:
        return f"hits for {query}"

    @app.agent(system="You plan.", max_tokens=100)
    async def planner(ctx, inputs):
        return (await ctx.llm(f"Plan: {ctx.inputs['task']}")).text

    @app.agent(after=[planner], max_tokens=200, calls=[web_search], agent_type="searcher_type")
    async def searcher(ctx, inputs):
        first = await ctx.llm("What to search?")
        hits = await ctx.call("web_search", query=first.text)
        return (await ctx.llm(f"Results: {hits}")).text

    @app.agent(after=[planner], max_tokens=10, importance=2.0)
    async def note(ctx, inputs):
        return (await ctx.llm("note")).text

    @app.agent(after=[searcher, note], max_tokens=50)
    async def writer(ctx, inputs):
        return (await ctx.llm(f"Write from {inputs}")).text

    return app


async def test_request_body_carries_tokencake_metadata_and_priority():
    app = _two_branch_app()
    llm = tc.ScriptedLLM(lambda req: f"{req.node}-{req.turn}")
    result = await app.run(llm=llm, run_id="run-7", task="cakes")
    assert result.output == "writer-0"
    bodies = {
        (b["kv_transfer_params"]["tokencake"]["node"], b["kv_transfer_params"]["tokencake"]["turn"]): b
        for b in llm.requests
    }
    assert len(llm.requests) == 5
    for (node, _turn), body in bodies.items():
        meta = RequestMeta.model_validate(body["kv_transfer_params"]["tokencake"])
        assert meta.session_id == f"run-7:{node}" and meta.run_id == "run-7" and meta.node == node
        assert meta.graph == app.meta(node)
        assert body["priority"] == priority_from_graph(meta.graph, meta.importance)
        assert body["model"] == "scripted"
    # planner -> searcher -> writer is critical (2 + 8 + 1 s), note has 8 - 0.2 s of slack, halved
    assert bodies[("searcher", 0)]["priority"] == 0
    note_meta = bodies[("note", 0)]["kv_transfer_params"]["tokencake"]
    assert note_meta["graph"]["slack_s"] == pytest.approx(7.8)
    assert note_meta["importance"] == 2.0
    assert bodies[("note", 0)]["priority"] == 4  # round(7.8 / 2)
    searcher = bodies[("searcher", 0)]["kv_transfer_params"]["tokencake"]
    assert searcher["agent_type"] == "searcher_type"
    assert searcher["next_stall"] == {"tool": "web_search", "kind": "search", "predicted_s": 4.0}
    # past its declared calls an agent is expected to call its last tool again (tool loops)
    assert bodies[("searcher", 1)]["kv_transfer_params"]["tokencake"]["next_stall"]["tool"] == "web_search"
    # an agent that declares no tool call never announces one
    assert bodies[("note", 0)]["kv_transfer_params"]["tokencake"]["next_stall"] is None
    assert bodies[("planner", 0)]["max_tokens"] == 100


async def test_conversation_continues_in_one_session_across_turns():
    app = _two_branch_app()
    llm = tc.ScriptedLLM(lambda req: f"{req.node}-{req.turn}")
    await app.run(llm=llm, run_id="r", task="t")
    searcher = [b for b in llm.requests if b["kv_transfer_params"]["tokencake"]["node"] == "searcher"]
    assert [b["kv_transfer_params"]["tokencake"]["turn"] for b in searcher] == [0, 1]
    assert searcher[1]["messages"] == [
        {"role": "user", "content": "What to search?"},
        {"role": "assistant", "content": "searcher-0"},
        {"role": "user", "content": "Results: hits for searcher-0"},
    ]
    planner = next(b for b in llm.requests if b["kv_transfer_params"]["tokencake"]["node"] == "planner")
    assert planner["messages"][0] == {"role": "system", "content": "You plan."}


async def test_new_session_and_system_prompt_rules():
    app = tc.App("sessions")
    sessions: list[str] = []

    @app.agent(system="S1")
    async def agent(ctx, inputs):
        await ctx.llm("one")
        sessions.append(ctx.session_id)
        with pytest.raises(ValueError, match="new_session=True"):
            await ctx.llm("two", system="S2")
        await ctx.llm("three", system="S2", new_session=True)
        sessions.append(ctx.session_id)
        return ctx.messages

    llm = tc.ScriptedLLM("ok")
    result = await app.run(llm=llm, run_id="r")
    assert sessions == ["r:agent", "r:agent#1"]
    assert result.output == [
        {"role": "system", "content": "S2"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "ok"},
    ]
    last = llm.requests[-1]["kv_transfer_params"]["tokencake"]
    assert last["session_id"] == "r:agent#1" and last["turn"] == 0


async def test_plain_llm_discovers_the_model_and_sends_the_key(monkeypatch):
    monkeypatch.setenv("TOKENCAKE_BASE_URL", "http://gpu-box:9000/v1")
    monkeypatch.setenv("TOKENCAKE_API_KEY", "k-123")
    monkeypatch.delenv("TOKENCAKE_MODEL", raising=False)
    monkeypatch.delenv("TOKENCAKE_EVENTS_URL", raising=False)
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        assert request.headers["authorization"] == "Bearer k-123"
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "smol", "object": "model"}]})
        body = json.loads(request.content)
        return httpx.Response(
            200,
            json={
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            },
        )

    llm = tc.LLM(http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    assert llm.base_url == "http://gpu-box:9000/v1" and llm.events_url is None
    assert llm.stall_reporter() is None
    app = _two_branch_app()
    result = await app.run(llm=llm, task="t")
    assert llm.model == "smol"
    assert [r.url.path for r in seen].count("/v1/models") == 1  # looked up once
    assert str(seen[1].url) == "http://gpu-box:9000/v1/chat/completions"
    assert result.usage == tc.Usage(15, 5, 20)


async def test_events_url_resolution(monkeypatch):
    monkeypatch.delenv("TOKENCAKE_EVENTS_URL", raising=False)
    assert tc.LLM("http://h:8000/v1", events_url="auto").events_url == "http://h:8001"
    assert tc.LLM("https://api.example/v1", events_url="auto").events_url == "https://api.example:444"
    assert tc.LLM("http://[::1]:8000/v1", events_url="auto").events_url == "http://[::1]:8001"
    assert tc.LLM("http://h:8000/v1", events_url="http://e:9/").events_url == "http://e:9"
    assert tc.LLM("http://h:8000/v1").events_url is None
    monkeypatch.setenv("TOKENCAKE_EVENTS_URL", "http://env:7")
    assert tc.LLM("http://h:8000/v1").events_url == "http://env:7"
    assert tc.LLM("http://h:8000/v1", events_url=False).events_url is None
    reporter = tc.LLM("http://h:8000/v1", api_key="k").stall_reporter()
    assert reporter is not None and reporter.url == "http://env:7/v1/events" and reporter.api_key == "k"


async def test_user_extra_body_is_merged_not_replaced():
    app = tc.App("extra")

    @app.agent()
    async def a(ctx, inputs):
        return await ctx.llm("x", extra_body={"top_k": 5, "kv_transfer_params": {"do_remote_prefill": False}})

    llm = tc.ScriptedLLM("ok")
    await app.run(llm=llm, run_id="r")
    body = llm.requests[0]
    assert body["top_k"] == 5
    assert body["kv_transfer_params"]["do_remote_prefill"] is False
    assert body["kv_transfer_params"]["tokencake"]["node"] == "a"
    assert body["priority"] == 0


def test_run_sync_twice_reuses_the_llm_across_event_loops():
    app = _two_branch_app()
    llm = tc.ScriptedLLM("ok")
    assert app.run_sync(llm=llm, task="1").output == "ok"
    assert app.run_sync(llm=llm, task="2").output == "ok"
    assert len(llm.requests) == 10


@pytest.mark.parametrize("events", [None, "http://gpu-box:9001"])
async def test_every_request_names_its_session_for_a_router(events):
    """``X-Session-ID`` on every chat completion (a router keeps the session on one replica); with
    no events listener the body says so, and the server derives the stalls from the requests."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = json.loads(request.content)
        message = {"role": "assistant", "content": "hi"}
        reply = {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"]}
        reply["choices"] = [{"index": 0, "finish_reason": "stop", "message": message}]
        return httpx.Response(200, json=reply)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    llm = tc.LLM("http://gpu-box:9000/v1", "smol", events_url=events or False, http_client=client)
    if events:  # the stall events of the searcher's tool call go nowhere here
        llm._reporter = tc.StallRecorder()
    await _two_branch_app().run(llm=llm, run_id="r", task="t")
    assert len(seen) == 5
    for request in seen:
        tc_meta = json.loads(request.content)["kv_transfer_params"]["tokencake"]
        assert request.headers["x-session-id"] == tc_meta["session_id"]
        if events:
            assert "stall_events" not in tc_meta  # the default: servers before the field agree
        else:
            assert tc_meta["stall_events"] is False


async def test_the_transport_adds_the_session_header():
    session = tc.Session("chat-7", events_url=False)
    seen: list[tuple[str, dict]] = []

    def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.headers.get("x-session-id", ""), body["kv_transfer_params"]["tokencake"]))
        message = {"role": "assistant", "content": "ok"}
        reply = {"id": "c", "object": "chat.completion", "created": 0, "model": "m"}
        reply["choices"] = [{"index": 0, "finish_reason": "stop", "message": message}]
        return httpx.Response(200, json=reply)

    client = tc.openai_client(session, base_url="http://llm.test/v1", transport=httpx.MockTransport(server))
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
    await client.close()
    ((header, tc_meta),) = seen
    assert header == "chat-7" and tc_meta["session_id"] == "chat-7" and tc_meta["stall_events"] is False


@pytest.mark.parametrize("case", ["explicit_reporter", "stall_off"])
async def test_requests_say_whether_this_runs_events_are_sent(case: str):
    # The flag used to follow the LLM's events URL, not what the run sends: an explicit reporter
    # on a remote LLM made the server derive a second stall per tool call; stall=False with an
    # events URL left it with none at all.
    seen: list[dict] = []

    def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path.endswith("/chat/completions"):
            seen.append(body["kv_transfer_params"]["tokencake"])
            message = {"role": "assistant", "content": "hi"}
            reply = {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"]}
            reply["choices"] = [{"index": 0, "finish_reason": "stop", "message": message}]
            return httpx.Response(200, json=reply)
        return httpx.Response(200, json={"ok": True, "status": "recorded"})

    transport = httpx.MockTransport(server)
    if case == "explicit_reporter":
        llm = tc.LLM(
            "http://gpu-box:9000/v1",
            "smol",
            events_url=False,
            http_client=httpx.AsyncClient(transport=transport),
        )
        stall = tc.HttpStallReporter("http://gpu-box:9001", transport=transport)
    else:
        llm = tc.LLM(
            "http://gpu-box:9000/v1",
            "smol",
            events_url="http://gpu-box:9001",
            http_client=httpx.AsyncClient(transport=transport),
        )
        stall = False
    await _two_branch_app().run(llm=llm, run_id="r", task="t", stall=stall)
    assert len(seen) == 5
    expected = None if case == "explicit_reporter" else False
    assert all(m.get("stall_events") is expected for m in seen), seen
