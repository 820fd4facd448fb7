"""A client with default settings behind a router: no events listener at port + 1, so it sends no
stall events and its requests say ``stall_events: false`` (with one warning), as ``_events_probe``
describes. With a listener there, nothing changes."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator

import httpx
import pytest

import tokencake as tc
from tokencake.agents import _events_probe
from tokencake.events import EventAck, StallBegin, StallEnd
from tokencake.serving.event_api import EventServer
from tokencake.serving.machine import find_free_port

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def fresh_verdicts() -> Iterator[None]:
    _events_probe._verdicts.clear()
    _events_probe._warned.clear()
    yield
    _events_probe._verdicts.clear()
    _events_probe._warned.clear()


def _app() -> tc.App:
    app = tc.App("behind_a_router", inputs=["task"])

    @app.tool(predict_time=0.2, kind="search")
    def look(term: str) -> str:
        return f"found {term}"

    @app.agent(max_tokens=8, calls=[look])
    async def agent(ctx, inputs):
        first = await ctx.llm("What to look up?")
        found = await ctx.call("look", term=first.text)
        return (await ctx.llm(f"Found: {found}")).text

    return app


class Chat:
    """A mocked OpenAI endpoint recording each request's TokenCake metadata."""

    def __init__(self) -> None:
        self.metas: list[dict[str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.metas.append(body["kv_transfer_params"]["tokencake"])
        message = {"role": "assistant", "content": "cake"}
        reply = {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"]}
        reply["choices"] = [{"index": 0, "finish_reason": "stop", "message": message}]
        return httpx.Response(200, json=reply)


def _llm(port: int, chat: Chat) -> tc.LLM:
    client = httpx.AsyncClient(transport=httpx.MockTransport(chat))
    return tc.LLM(f"http://127.0.0.1:{port}/v1", "m", http_client=client)


def _events_seen() -> tuple[list[StallBegin | StallEnd], EventServer, int]:
    port = find_free_port(with_events=True)
    seen: list[StallBegin | StallEnd] = []

    def record(ev: StallBegin | StallEnd) -> EventAck:
        seen.append(ev)
        return EventAck(ok=True, status="recorded")

    return seen, EventServer("127.0.0.1", port + 1, record), port


async def test_behind_a_router_the_requests_say_stall_events_false_and_no_event_is_sent() -> None:
    port = find_free_port(with_events=True)
    status = EventServer("127.0.0.1", port + 1, None, stats_fn=lambda: {"replicas": []})  # the router's +1
    chat = Chat()
    with status, pytest.warns(RuntimeWarning, match="router's status port") as caught:
        llm = _llm(port, chat)
        for _ in range(2):
            assert (await _app().run(llm=llm, task="t")).status == "ok"
        await _app().run(llm=_llm(port, chat), task="t")  # another client in the process: no new warning
    assert len([w for w in caught if "events listener" in str(w.message)]) == 1
    assert len(chat.metas) == 6 and all(m["stall_events"] is False for m in chat.metas), chat.metas
    counters = status.metrics.snapshot()["counters"]
    assert not any(k.startswith("events.") for k in counters), counters  # no event posted there


async def test_with_nothing_at_port_plus_one_the_server_derives_the_stalls() -> None:
    port = find_free_port(with_events=True)
    chat = Chat()
    with pytest.warns(RuntimeWarning, match="nothing answers"):
        assert (await _app().run(llm=_llm(port, chat), task="t")).status == "ok"
    assert [m["stall_events"] for m in chat.metas] == [False, False]


async def test_with_an_events_listener_at_port_plus_one_nothing_changes() -> None:
    seen, listener, port = _events_seen()
    chat = Chat()
    with listener, warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        llm = _llm(port, chat)
        assert (await _app().run(llm=llm, task="t")).status == "ok"
        await llm.aclose()
    assert all("stall_events" not in m for m in chat.metas)  # the default: true
    assert [type(e).__name__ for e in seen] == ["StallBegin", "StallEnd"]


def test_a_session_behind_a_router_says_stall_events_false() -> None:
    port = find_free_port(with_events=True)
    with EventServer("127.0.0.1", port + 1, None), pytest.warns(RuntimeWarning, match="status port"):
        session = tc.Session("chat-1", base_url=f"http://127.0.0.1:{port}/v1")
        assert session.request_metadata()["kv_transfer_params"]["tokencake"]["stall_events"] is False  # type: ignore[index]
    assert session.reporter is None and session.events_url is None
    _seen, listener, port = _events_seen()
    with listener:
        session = tc.Session("chat-2", base_url=f"http://127.0.0.1:{port}/v1")
        meta = session.request_metadata()["kv_transfer_params"]["tokencake"]  # type: ignore[index]
        assert "stall_events" not in meta and session.reporter is not None


def test_only_the_derived_loopback_url_is_probed() -> None:
    derived = "http://127.0.0.1:8001"
    assert _events_probe.is_derived_local(derived, derived)
    assert not _events_probe.is_derived_local("http://127.0.0.1:9999", derived)  # named elsewhere
    assert not _events_probe.is_derived_local("http://gpu-box:8001", "http://gpu-box:8001")  # remote
    assert not _events_probe.is_derived_local(None, derived)
