"""Issue 13, point 2: the public integration layer (``tc.Session``, ``tc.stall``, ``tc.request_metadata``,
``tc.TokenCakeTransport``, ``tc.openai_client``), offline against the real OpenAI wire format."""

import contextvars
import json
import warnings

import anyio
import httpx
import openai
import pytest

import tokencake as tc
from tokencake.events import GraphMeta, NextStall, RequestMeta, StallBegin, StallEnd

pytestmark = pytest.mark.anyio


class _Server:
    """A fake OpenAI-compatible server: records request bodies, answers chat completions."""

    def __init__(self, replies: list[dict] | None = None) -> None:
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.replies = list(replies or [])

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(f"{request.method} {request.url.path}")
        if request.url.path.endswith("/models"):
            return httpx.Response(
                200,
                json={
                    "object": "list",
                    "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "x"}],
                },
            )
        body = json.loads(request.content)
        self.bodies.append(body)
        message = self.replies.pop(0) if self.replies else {"role": "assistant", "content": "ok"}
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        if body.get("stream"):
            chunk = {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "m",
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                ],
            }
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                content=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(),
            )
        return httpx.Response(
            200,
            json={
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            },
        )


def _tc_fields(body: dict) -> dict:
    return body["kv_transfer_params"]["tokencake"]


# ---------------------------------------------------------------------- stall


async def test_stall_brackets_the_block_with_begin_and_end():
    rec = tc.StallRecorder()
    session = tc.Session("chat-1", events_url=False, hooks=rec, node="helper")
    async with tc.stall(session, "search", kind="search", predicted_s=2.0, stages={"query": 1.0}) as stall:
        assert [type(e) for e in rec.events] == [StallBegin]  # sent before the block runs
        await anyio.sleep(0.05)
    ((begin, end),) = rec.pairs()
    assert isinstance(stall, tc.StallScope) and stall.end is end
    assert begin.session_id == end.session_id == "chat-1"
    assert begin.run_id == "chat-1" and begin.node == "helper" and begin.agent_type == "helper"
    assert (begin.tool, begin.kind, begin.predicted_s, begin.stages) == (
        "search",
        "search",
        2.0,
        {"query": 1.0},
    )
    assert end.outcome == "ok" and end.error is None and end.duration_s >= 0.05
    async with session.stall("search"):
        pass
    ids = [b.stall_id for b, _ in rec.pairs()]
    assert len(set(ids)) == 2


async def test_stall_end_is_sent_on_error_timeout_and_cancellation():
    rec = tc.StallRecorder()
    session = tc.Session("chat-2", events_url=False, hooks=[rec])
    with pytest.raises(ValueError, match="boom"):
        async with tc.stall(session, "calc"):
            raise ValueError("boom")
    with pytest.raises(TimeoutError):
        async with tc.stall(session, "calc"):
            raise TimeoutError("too slow")
    with anyio.move_on_after(0.05):
        async with tc.stall(session, "calc"):
            await anyio.sleep(10)
    ends = [e for _, e in rec.pairs()]
    assert [e.outcome for e in ends] == ["error", "timeout", "cancelled"]
    assert ends[0].error == "ValueError: boom" and ends[2].error is None


async def test_stall_end_is_delivered_even_while_the_task_is_cancelled():
    class SlowHook:
        def __init__(self):
            self.ends: list[StallEnd] = []

        async def begin(self, ev):
            return None

        async def end(self, ev):
            await anyio.sleep(0.1)  # a real POST takes time; cancellation must not drop it
            self.ends.append(ev)

    hook = SlowHook()
    session = tc.Session("chat-3", events_url=False, hooks=hook)
    with anyio.move_on_after(0.05):
        async with tc.stall(session, "wait"):
            await anyio.sleep(10)
    assert [e.outcome for e in hook.ends] == ["cancelled"]


async def test_stall_posts_wire_events_through_the_http_reporter():
    posted: list[dict] = []

    def events_server(request: httpx.Request) -> httpx.Response:
        posted.append(
            {
                "path": request.url.path,
                "auth": request.headers.get("authorization"),
                **json.loads(request.content),
            }
        )
        return httpx.Response(200, json={"ok": True, "status": "recorded"})

    reporter = tc.HttpStallReporter(
        "http://events.test", api_key="k", transport=httpx.MockTransport(events_server)
    )
    session = tc.Session("chat-4", events_url=False, hooks=reporter)
    async with tc.stall(session, "fetch", predicted_s=1.5):
        pass
    assert [(p["path"], p["type"], p["auth"]) for p in posted] == [
        ("/v1/events", "stall_begin", "Bearer k"),
        ("/v1/events", "stall_end", "Bearer k"),
    ]
    assert posted[0]["session_id"] == "chat-4" and posted[0]["predicted_s"] == 1.5
    assert reporter.sent == 2 and reporter.failures == 0
    await reporter.aclose()


def test_session_events_url_follows_the_llm_rules(monkeypatch):
    monkeypatch.delenv("TOKENCAKE_EVENTS_URL", raising=False)
    monkeypatch.delenv("TOKENCAKE_BASE_URL", raising=False)
    assert tc.Session("a").events_url == "http://127.0.0.1:8001"  # the local `tokencake serve` layout
    assert tc.Session("b", base_url="http://127.0.0.1:9000/v1").events_url == "http://127.0.0.1:9001"
    assert tc.Session("c", base_url="https://api.example.com/v1").events_url is None
    assert tc.Session("d", events_url="http://ev:7/").reporter.url == "http://ev:7/v1/events"
    assert tc.Session("e", events_url=False).reporter is None
    one, two = tc.Session("f", events_url="http://ev:7"), tc.Session("g", events_url="http://ev:7")
    assert one.reporter is two.reporter  # one reporter (pool, warning) per events URL
    with pytest.raises(TypeError, match=r"tc\.Session"):
        tc.stall("chat-5", "tool")
    with pytest.raises(ValueError, match="session_id"):
        tc.Session("x" * 401)


def test_use_server_points_an_unnamed_session_at_the_chat_server(monkeypatch):
    monkeypatch.delenv("TOKENCAKE_EVENTS_URL", raising=False)
    monkeypatch.delenv("TOKENCAKE_BASE_URL", raising=False)
    rec = tc.StallRecorder()
    session = tc.Session("u", hooks=rec)
    session.use_server("http://127.0.0.1:18400/v1/")
    assert (session.base_url, session.events_url) == ("http://127.0.0.1:18400/v1", "http://127.0.0.1:18401")
    assert session.reporter is tc.Session("u2", base_url="http://127.0.0.1:18400/v1").reporter
    assert session.hooks.hooks == [rec, session.reporter]  # the user's hooks are kept
    remote = tc.Session("r")
    remote.use_server("https://api.example.com/v1")  # not loopback: no events listener is assumed
    assert (remote.base_url, remote.events_url, remote.reporter) == ("https://api.example.com/v1", None, None)
    quiet = tc.Session("q", events_url=False)  # events named (off): the chat URL is still taken
    quiet.use_server("http://127.0.0.1:18400/v1")
    assert (quiet.base_url, quiet.events_url) == ("http://127.0.0.1:18400/v1", None)


def test_use_server_keeps_a_named_server_and_says_when_events_go_elsewhere(monkeypatch):
    monkeypatch.delenv("TOKENCAKE_EVENTS_URL", raising=False)
    monkeypatch.setenv("TOKENCAKE_BASE_URL", "http://127.0.0.1:8000/v1")
    named = tc.Session("n")  # named by the environment
    with pytest.warns(
        RuntimeWarning, match=r"'n': chat completions go to http://127.0.0.1:9000/v1 but stall"
    ):
        named.use_server("http://127.0.0.1:9000/v1")
    named.use_server("http://127.0.0.1:9100/v1")  # once per session
    assert (named.base_url, named.events_url) == ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8001")
    remote_events = tc.Session("e", events_url="http://10.0.0.7:8001")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remote_events.use_server("http://10.0.0.7:8000/v1")  # same host as the named events: fine
        named.use_server("http://127.0.0.1:8000/v1")
    with pytest.warns(RuntimeWarning, match="stall events to http://10.0.0.7:8001"):
        remote_events.use_server("http://10.0.0.9:8000/v1")


# ---------------------------------------------------------------------- metadata


async def test_request_metadata_builds_exactly_what_the_llm_class_sends():
    app = tc.App("parity")

    @app.tool(predict_time=3.0, kind="search")
    def look(q: str) -> str:
        return q

    @app.agent(calls=[look], importance=2.0, agent_type="looker")
    async def agent(ctx, inputs):
        await ctx.llm("hi")
        return 1

    @app.agent(max_tokens=5000)
    async def long_one(ctx, inputs):
        await ctx.llm("hi")
        return 1

    llm = tc.ScriptedLLM("x")
    await app.run(llm=llm, run_id="r-9")
    for body in llm.requests:
        meta = RequestMeta.model_validate(_tc_fields(body))
        built = tc.request_metadata(
            meta.session_id,
            run_id=meta.run_id,
            node=meta.node,
            agent_type=meta.agent_type,
            turn=meta.turn,
            importance=meta.importance,
            graph=meta.graph,
            next_stall=meta.next_stall,
            stall_events=meta.stall_events,  # False here: a scripted LLM has no events listener
        )
        assert built == {"priority": body["priority"], "kv_transfer_params": body["kv_transfer_params"]}
    assert {b["priority"] for b in llm.requests} != {0}  # the check covered a non-zero priority too


def test_request_metadata_defaults_for_a_standalone_agent():
    body = tc.request_metadata("chat-42", turn=3, next_stall="web_search")
    assert body["priority"] == 0  # an agent outside an app is its own critical path
    meta = RequestMeta.model_validate(_tc_fields(body))
    assert (meta.session_id, meta.run_id, meta.node, meta.agent_type, meta.turn) == (
        "chat-42",
        "chat-42",
        "agent",
        "agent",
        3,
    )
    assert meta.next_stall == NextStall(tool="web_search")
    slack = tc.request_metadata("s", graph=GraphMeta(on_critical_path=False, slack_s=12.0), priority=None)
    assert slack["priority"] == 12
    assert tc.request_metadata("s", priority=7)["priority"] == 7


# ---------------------------------------------------------------------- transport / client


async def test_openai_client_stamps_every_chat_completion_of_the_session():
    server = _Server()
    session = tc.Session("chat-42", events_url=False, importance=1.0)
    client = tc.openai_client(session, base_url="http://llm.test/v1", transport=httpx.MockTransport(server))
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
    await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "b"}],
        extra_body={"priority": 5, "kv_transfer_params": {"other": {"x": 1}}},
    )
    stream = await client.chat.completions.create(model="m", messages=[], stream=True)
    assert [c.choices[0].delta.content async for c in stream] == ["ok"]
    await client.models.list()
    await client.close()
    assert [_tc_fields(b)["session_id"] for b in server.bodies] == ["chat-42"] * 3
    assert [_tc_fields(b)["turn"] for b in server.bodies] == [0, 1, 2]
    assert server.bodies[0]["priority"] == 0
    # the caller's own fields win and survive
    assert server.bodies[1]["priority"] == 5
    assert server.bodies[1]["kv_transfer_params"]["other"] == {"x": 1}
    assert (
        server.bodies[0]["messages"] == [{"role": "user", "content": "a"}]
        and server.bodies[0]["model"] == "m"
    )
    assert server.paths[-1] == "GET /v1/models" and session.turn == 3


def test_transport_works_for_sync_clients_and_picks_the_current_session():
    server = _Server()
    current: contextvars.ContextVar[tc.Session | None] = contextvars.ContextVar("current", default=None)
    transport = tc.TokenCakeTransport(current.get, transport=httpx.MockTransport(server))
    a, b = tc.Session("thread-a", events_url=False), tc.Session("thread-b", events_url=False)
    with httpx.Client(transport=transport, base_url="http://llm.test/v1") as http:
        for session in (a, b, a, None):
            current.set(session)
            response = http.post("/chat/completions", json={"model": "m", "messages": []})
            assert response.status_code == 200
        current.set(a)
        http.post("/embeddings", json={"model": "m", "input": "x"})  # not a chat completion
    stamped = [
        _tc_fields(body)["session_id"] if "kv_transfer_params" in body else None for body in server.bodies
    ]
    assert stamped == [
        "thread-a",
        "thread-b",
        "thread-a",
        None,  # no current session: the request goes out unchanged
        None,  # other endpoints pass through untouched
    ]
    assert [_tc_fields(body)["turn"] for body in server.bodies[:3]] == [0, 0, 1]
    assert a.turn == 2


async def test_an_agent_loop_with_the_plain_openai_client_shares_one_session():
    """What an adapter does: chat -> tool (stall) -> chat, all under one session id."""
    call = {"id": "t1", "type": "function", "function": {"name": "search", "arguments": '{"q": "kv"}'}}
    server = _Server([{"role": "assistant", "content": None, "tool_calls": [call]}])
    rec = tc.StallRecorder()
    session = tc.Session(node="researcher", events_url=False, hooks=rec, next_stall="search")
    client = openai.AsyncOpenAI(
        base_url="http://llm.test/v1",
        api_key="x",
        http_client=httpx.AsyncClient(transport=tc.TokenCakeTransport(session, httpx.MockTransport(server))),
    )
    messages = [{"role": "user", "content": "research kv caches"}]
    first = await client.chat.completions.create(model="m", messages=messages)
    tool_call = first.choices[0].message.tool_calls[0]
    async with tc.stall(session, tool_call.function.name, kind="search", predicted_s=1.0):
        result = "hits"
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": "t1", "content": result},
    ]
    await client.chat.completions.create(model="m", messages=messages)
    await client.close()
    ((begin, end),) = rec.pairs()
    sessions = {_tc_fields(b)["session_id"] for b in server.bodies}
    assert sessions == {begin.session_id} == {end.session_id} == {session.session_id}
    assert session.session_id.startswith("session-")
    assert _tc_fields(server.bodies[0])["next_stall"]["tool"] == "search"
    assert [_tc_fields(b)["turn"] for b in server.bodies] == [0, 1]


def test_openai_client_defaults_to_the_sessions_server(monkeypatch):
    monkeypatch.delenv("TOKENCAKE_BASE_URL", raising=False)
    monkeypatch.delenv("TOKENCAKE_API_KEY", raising=False)
    session = tc.Session("s-url", base_url="http://10.0.0.7:9000/v1/", api_key="k1", events_url=False)
    client = tc.openai_client(session)
    assert str(client.base_url) == "http://10.0.0.7:9000/v1/" and client.api_key == "k1"
    other = tc.openai_client(session, base_url="http://127.0.0.1:1/v1", api_key="k2")
    assert str(other.base_url).startswith("http://127.0.0.1:1/v1") and other.api_key == "k2"
    assert str(tc.openai_client(lambda: session).base_url).startswith("http://127.0.0.1:8000")
