"""A Pydantic AI agent on a TokenCake server (docs/integrations.md, "pydantic_ai").

    python examples/pydantic_ai_research.py             # against TOKENCAKE_BASE_URL (tokencake serve)
    python examples/pydantic_ai_research.py --offline   # on tc.testing's scripted server

The TokenCake capability keys sessions by conversation and agent, stamps every model request and
brackets every tool call with stall_begin / stall_end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import openai
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

import tokencake as tc
from tokencake.integrations.pydantic_ai import TokenCake

BASE_URL = os.environ.get("TOKENCAKE_BASE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("TOKENCAKE_MODEL", "smollm2-135m-instruct")


# --8<-- [start:agent]
async def web_search(query: str) -> str:
    """Search the web."""
    return f"3 pages about {query}"


def build(client: openai.AsyncOpenAI | None = None, **session_options: Any) -> Agent[None, str]:
    """The agent; ``client`` replaces the network (tests), ``session_options`` go to the sessions."""
    client = client or openai.AsyncOpenAI(base_url=BASE_URL, api_key="EMPTY")  # also the sessions' server
    return Agent(
        OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client)),
        name="researcher",
        tools=[web_search],
        capabilities=[TokenCake(predicted_s={"web_search": 2.0}, **session_options)],
    )


async def converse(agent: Agent[None, str]) -> list[str]:
    """Two turns of one conversation (one TokenCake session: same conversation_id, same agent)."""
    first = await agent.run("What is paged attention?")
    more = await agent.run("And KV offloading?", message_history=first.all_messages())
    return [first.output, more.output]


# --8<-- [end:agent]


# --8<-- [start:test]
def search_script(req: tc.ScriptedRequest) -> str | tc.ToolCall:
    """The model's part: search once, then answer from the result."""
    if req.tool_results:
        return f"Found {req.tool_results[-1]}."
    return tc.ToolCall(f"call-{req.index}", "web_search", {"query": req.prompt})


async def test_converse_offline() -> None:
    server = tc.testing.ScriptedTransport(search_script)
    stalls = tc.StallRecorder()
    agent = build(server.openai_client(), events_url=False, hooks=stalls)
    assert await converse(agent) == [
        "Found 3 pages about What is paged attention?.",
        "Found 3 pages about And KV offloading?.",
    ]
    sessions = {r["kv_transfer_params"]["tokencake"]["session_id"] for r in server.requests}
    assert len(server.requests) == 4 and len(sessions) == 1
    pairs = tc.testing.closed_pairs(stalls)
    assert [(begin.tool, end.outcome) for begin, end in pairs] == [("web_search", "ok")] * 2


# --8<-- [end:test]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offline", action="store_true", help="run on tc.testing's scripted server")
    args = parser.parse_args(argv)
    if args.offline:
        asyncio.run(test_converse_offline())
        print("offline: 4 stamped requests, 2 closed stalls")
        return 0
    for answer in asyncio.run(converse(build())):
        print(answer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
