"""Transparent mode's stall events: their fields, and a poster that never raises (refused, rejected,
timed out: counted, logged once, begins dropped for a while after a timeout)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tokencake.events import StallBegin
from tokencake.serving.transparent import TRANSPARENT_NODE, Conversation, OpenCall
from tokencake.serving.transparent_events import (
    EVENTS_URL_ENV,
    MAX_CONVERSATIONS_ENV,
    EventPoster,
    TransparentConfig,
    begin_event,
    end_event,
)


def test_the_events_name_the_call_and_the_mode() -> None:
    conv = Conversation("transparent-abc")
    call = OpenCall("call_1", "call_1@x.0", "get_weather", begun_at=100.0)
    begin = begin_event(conv, call)
    assert (begin.stall_id, begin.session_id, begin.run_id, begin.tool) == (
        "call_1@x.0",
        "transparent-abc",
        "transparent-abc",
        "get_weather",
    )
    assert begin.node == begin.agent_type == TRANSPARENT_NODE and begin.predicted_s is None
    end = end_event(conv, call, now=102.5)
    assert (end.stall_id, end.node, end.outcome, end.duration_s) == (
        "call_1@x.0",
        TRANSPARENT_NODE,
        "ok",
        2.5,
    )
    assert end_event(conv, call, now=99.0).duration_s == 0.0


def _begin(stall_id: str) -> StallBegin:
    return StallBegin(stall_id=stall_id, session_id="s", run_id="s", node=TRANSPARENT_NODE, tool="t", ts=1.0)


def test_the_poster_never_raises() -> None:
    answers: list[httpx.Response | Exception] = [
        httpx.Response(200, json={"ok": True, "status": "recorded"}),
        httpx.Response(200, json={"ok": True, "status": "duplicate"}),
        httpx.Response(404, json={"ok": False, "status": "rejected", "reason": "unknown_stall"}),
        httpx.Response(502, text="bad gateway"),
        httpx.ReadTimeout("slow"),
        httpx.Response(200, json={"ok": True, "status": "recorded"}),
    ]
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content)["stall_id"])
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    poster = EventPoster(TransparentConfig("http://e", cooldown_s=60.0), httpx.MockTransport(handler))

    async def scenario() -> list[bool]:
        results = [await poster.post(_begin(f"b{i}")) for i in range(5)]
        results.append(await poster.post(_begin("skipped")))  # in the cooldown after the timeout
        results.append(await poster.post(_begin("owed"), owed=True))  # an end owed: always tried
        return results

    assert asyncio.run(scenario()) == [True, True, False, False, False, False, True]
    assert seen == ["b0", "b1", "b2", "b3", "b4", "owed"]
    assert poster.counts == {"sent.stall_begin": 3, "rejected": 1, "failed": 2, "skipped": 1}


def test_config_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config = TransparentConfig.from_env(
        {
            EVENTS_URL_ENV: "http://127.0.0.1:8001/",
            "TOKENCAKE_EVENTS_API_KEY": "k",
            MAX_CONVERSATIONS_ENV: "12",
        }
    )
    assert (config.events_url, config.events_api_key, config.max_conversations) == (
        "http://127.0.0.1:8001",
        "k",
        12,
    )
    assert TransparentConfig.from_env({MAX_CONVERSATIONS_ENV: "lots"}).max_conversations == 4096
    assert TransparentConfig.from_env({}).events_url is None
    monkeypatch.setenv(EVENTS_URL_ENV, "http://e:1")
    assert TransparentConfig.from_env().events_url == "http://e:1"
