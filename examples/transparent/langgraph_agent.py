"""A LangChain ``create_agent`` (LangGraph) agent on an OpenAI-compatible server, no TokenCake import.

See docs/transparent.md.

    tokencake serve &
    python examples/transparent/langgraph_agent.py --base-url http://127.0.0.1:8000/v1

One conversation (one checkpointer thread), three questions; each makes the agent call
``lookup_order`` (a 1.5 s lookup) once, then answer from its result. The model is a ``ChatOpenAI``
on the server's base URL; ``tokencake serve`` recognises its tool-call turns on its own
(transparent mode).

The bundled 135M model cannot decide to call a tool by itself, so the ``force_lookup`` middleware
forces the call on a question's first request (a named ``tool_choice``) and turns tools off
(``"none"``) once the tool answered; a capable model needs neither.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable

from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, ModelResponse, wrap_model_call
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

INSTRUCTIONS = "You are a support agent. Look orders up with the lookup_order tool, then answer in one line."
QUESTIONS = ("Where is order 42?", "And order 7?", "And order 13?")
TOOL_SECONDS = 1.5

tool_calls = 0


@tool
async def lookup_order(order_id: str) -> str:
    """Look up an order's shipping status.

    Args:
        order_id: the order number.
    """
    global tool_calls
    tool_calls += 1
    await asyncio.sleep(TOOL_SECONDS)
    return f"order {order_id}: shipped yesterday, arrives tomorrow"


@wrap_model_call
async def force_lookup(
    request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
) -> ModelResponse:
    """``lookup_order`` forced until a tool answered, then ``"none"``."""
    answered = bool(request.messages) and isinstance(request.messages[-1], ToolMessage)
    return await handler(request.override(tool_choice="none" if answered else "lookup_order"))


async def chat(base_url: str, model: str, api_key: str) -> list[str]:
    """The conversation: one thread, one question per invocation."""
    llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_tokens=64, temperature=0.0)
    agent = create_agent(
        llm,
        [lookup_order],
        system_prompt=INSTRUCTIONS,
        middleware=[force_lookup],
        checkpointer=InMemorySaver(),
    )
    config = {"configurable": {"thread_id": "support-1"}}
    answers = []
    for question in QUESTIONS:
        state = await agent.ainvoke({"messages": [{"role": "user", "content": question}]}, config)
        answers.append(str(state["messages"][-1].content))
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key", default="EMPTY")
    args = parser.parse_args(argv)
    for answer in asyncio.run(chat(args.base_url, args.model, args.api_key)):
        print(answer)
    print(f"tool calls: {tool_calls}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
