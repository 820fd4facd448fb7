"""``tc.testing``: the offline scripted OpenAI server and the stall checks, from plain clients."""

import asyncio

import httpx
import openai
import pytest

import tokencake as tc


def test_sync_and_async_clients_get_text_tool_calls_and_parallel_calls():
    server = tc.testing.ScriptedTransport(
        [
            "hello",
            tc.ToolCall("c1", "search", {"q": "kv"}),
            [tc.ToolCall("a", "x", {}), tc.ToolCall("b", "y", {})],
        ]
    )
    sync = openai.OpenAI(base_url=server.base_url, api_key="k", http_client=server.http_client())
    first = sync.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert first.choices[0].message.content == "hello"

    async def more():
        client = server.openai_client()
        one = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "find"}])
        two = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "both"}])
        return one, two

    one, two = asyncio.run(more())
    (call,) = one.choices[0].message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == ("c1", "search", '{"q": "kv"}')
    assert [c.function.name for c in two.choices[0].message.tool_calls] == ["x", "y"]
    assert [b["messages"][0]["content"] for b in server.requests] == ["hi", "find", "both"]


def test_streamed_replies_reach_sync_and_async_clients():
    server = tc.testing.ScriptedTransport("one two three")
    sync = openai.OpenAI(base_url=server.base_url, api_key="k", http_client=server.http_client())
    chunks = sync.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two three"

    async def streamed() -> str:
        stream = await server.openai_client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    assert asyncio.run(streamed()) == "one two three"


def test_a_sync_client_works_inside_a_running_event_loop():
    server = tc.testing.ScriptedTransport("fine")

    async def inside() -> str:
        response = httpx.Client(transport=server).post(
            server.base_url + "/chat/completions", json={"model": "m", "messages": []}
        )
        return response.json()["choices"][0]["message"]["content"]

    assert asyncio.run(inside()) == "fine"


def test_the_session_client_stamps_requests_and_kv_provenance_is_answered():
    session = tc.Session("chat-1", events_url=False)
    kv = tc.testing.kv_provenance(50, kept_tokens=16, prefetched_tokens=16, loaded_tokens=8)
    server = tc.testing.ScriptedTransport(["a", "b"], kv=lambda req: kv if req.turn == 1 else None)

    async def two() -> list:
        client = server.openai_client(session)
        return [
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
            for _ in range(2)
        ]

    first, second = asyncio.run(two())
    assert [b["kv_transfer_params"]["tokencake"]["turn"] for b in server.requests] == [0, 1]
    assert (first.model_extra or {}).get("kv_transfer_params") is None
    assert second.model_extra["kv_transfer_params"] == {
        "tokencake_kv": {
            "device_tokens": 32,
            "prefetched_tokens": 16,
            "copied_tokens": 16,
            "host_tokens": 8,
            "prompt_tokens": 50,
            "admissions": 1,
            "failed_copy_tokens": 0,
            "failed_load_tokens": 0,
        }
    }


def test_closed_pairs_names_what_is_wrong():
    rec = tc.StallRecorder()
    session = tc.Session("s", events_url=False, hooks=rec)

    async def stalls() -> None:
        async with tc.stall(session, "search"):
            pass
        await session.stall("open").__aenter__()  # begun, never ended

    asyncio.run(stalls())
    with pytest.raises(AssertionError, match=r"stall .*:2 \(open\) has no stall_end"):
        tc.testing.closed_pairs(rec)
    rec.events.pop()
    ((begin, end),) = tc.testing.closed_pairs(rec)
    assert (begin.tool, end.outcome) == ("search", "ok")
    rec.events.append(end)
    with pytest.raises(AssertionError, match="3 events for 1 stalls"):
        tc.testing.closed_pairs(rec)
