"""The SDK's clients never write a request to a connection the server is closing as idle."""

import asyncio
import json
import time

import pytest

import tokencake as tc
from tokencake.agents._http import KEEPALIVE_EXPIRY_S

pytestmark = pytest.mark.anyio

_REPLY = json.dumps(
    {
        "id": "c",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


class _ClosingServer:
    """Keep-alive HTTP/1.1 that, like uvicorn, drops a connection idle for ``idle_close_s``.

    The drop is modelled at its worst moment: the request that arrives after the idle limit finds
    the connection closing and gets no response (what a client sees when its write races the
    server's keep-alive timer).
    """

    def __init__(self, idle_close_s: float) -> None:
        self.idle_close_s = idle_close_s
        self.connections = 0
        self.dropped = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        last = time.monotonic()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode().split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                await reader.readexactly(length)
                if time.monotonic() - last > self.idle_close_s:
                    self.dropped += 1
                    return
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(_REPLY)}\r\n\r\n".encode()
                    + _REPLY
                )
                await writer.drain()
                last = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


async def _two_calls_around_an_idle_pause(call) -> _ClosingServer:
    server = _ClosingServer(idle_close_s=KEEPALIVE_EXPIRY_S + 0.15)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        await call(f"http://127.0.0.1:{port}/v1")
        await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.35)  # a tool call longer than our keep-alive
        await call(f"http://127.0.0.1:{port}/v1")
    finally:
        listener.close()
    return server


async def test_an_llm_call_after_an_idle_pause_opens_a_fresh_connection():
    # With httpx's default 5 s expiry (= the server's) the second request reused the closing
    # connection and failed with a connection error, as one app did in a real bench run.
    llm_holder: dict[str, tc.LLM] = {}

    async def same_client(base_url: str) -> None:
        llm = llm_holder.setdefault(
            "llm", tc.LLM(base_url=base_url, model="m", events_url=False, max_retries=0)
        )
        assert (await llm.chat([{"role": "user", "content": "hi"}])).text == "ok"

    server = await _two_calls_around_an_idle_pause(same_client)
    assert server.dropped == 0 and server.connections == 2


async def test_openai_client_with_session_metadata_also_expires_idle_connections():
    holder: dict[str, object] = {}

    async def same_client(base_url: str) -> None:
        client = holder.setdefault(
            "client", tc.openai_client(tc.Session("s"), base_url=base_url, max_retries=0)
        )
        out = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content == "ok"

    server = await _two_calls_around_an_idle_pause(same_client)
    assert server.dropped == 0 and server.connections == 2


def test_vllms_server_keeps_idle_connections_longer_than_the_sdk(monkeypatch):
    # The expiry above only helps while the server's keep-alive is the longer one.
    envs = pytest.importorskip("vllm.envs")
    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    assert envs.environment_variables["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]() >= 2 * KEEPALIVE_EXPIRY_S
