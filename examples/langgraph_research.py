"""A LangChain / LangGraph agent on a TokenCake server (docs/integrations.md, "langgraph").

    python examples/langgraph_research.py             # against TOKENCAKE_BASE_URL (tokencake serve)
    python examples/langgraph_research.py --offline   # on tc.testing's scripted server

TokenCakeMiddleware keys sessions by thread and agent, stamps every model call and brackets every
tool call with stall_begin / stall_end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import httpx
from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

import tokencake as tc
from tokencake.integrations.langgraph import TokenCakeMiddleware

BASE_URL = os.environ.get("TOKENCAKE_BASE_URL", "http://127.0.0.1:8000/v1")
MODEL = os.environ.get("TOKENCAKE_MODEL", "smollm2-135m-instruct")


# --8<-- [start:agent]
@tool
async def web_search(query: str) -> str:
    """Search the web."""
    return f"3 pages about {query}"


def build(transport: httpx.AsyncBaseTransport | None = None, **session_options: Any) -> Any:
    """The agent; ``transport`` replaces the network (tests), ``session_options`` go to the sessions."""
    tk = TokenCakeMiddleware(predicted_s={"web_search": 2.0}, **session_options)
    model = ChatOpenAI(
        model=MODEL,
        base_url=BASE_URL,  # the sessions' server too: stall events go to its port + 1
        api_key="EMPTY",
        http_async_client=httpx.AsyncClient(transport=tk.transport(transport)),  # KV reports
    )
    return create_agent(model, [web_search], middleware=[tk], name="researcher", checkpointer=InMemorySaver())


async def ask(agent: Any, question: str, thread_id: str) -> str:
    """One turn of conversation ``thread_id`` (one TokenCake session per thread and agent)."""
    messages = {"messages": [{"role": "user", "content": question}]}
    out = await agent.ainvoke(messages, {"configurable": {"thread_id": thread_id}})
    return str(out["messages"][-1].content)


# --8<-- [end:agent]


# --8<-- [start:test]
def search_script(req: tc.ScriptedRequest) -> str | tc.ToolCall:
    """The model's part: search once, then answer from the result."""
    if req.tool_results:
        return f"Found {req.tool_results[-1]}."
    return tc.ToolCall(f"call-{req.index}", "web_search", {"query": req.prompt})


async def test_ask_offline() -> None:
    server = tc.testing.ScriptedTransport(search_script)
    stalls = tc.StallRecorder()
    agent = build(server, events_url=False, hooks=stalls)
    assert await ask(agent, "paged attention", "chat-42") == "Found 3 pages about paged attention."
    assert await ask(agent, "KV offloading", "chat-42") == "Found 3 pages about KV offloading."
    sessions = {r["kv_transfer_params"]["tokencake"]["session_id"] for r in server.requests}
    assert len(server.requests) == 4 and len(sessions) == 1  # one thread, one agent: one session
    pairs = tc.testing.closed_pairs(stalls)
    assert [(begin.tool, end.outcome) for begin, end in pairs] == [("web_search", "ok")] * 2


# --8<-- [end:test]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offline", action="store_true", help="run on tc.testing's scripted server")
    args = parser.parse_args(argv)
    if args.offline:
        asyncio.run(test_ask_offline())
        print("offline: 4 stamped requests, 2 closed stalls")
        return 0
    agent = build()
    print(asyncio.run(ask(agent, "What is paged attention?", "chat-42")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
