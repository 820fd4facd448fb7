"""A Pydantic AI agent on an OpenAI-compatible server, no TokenCake import (docs/transparent.md).

    tokencake serve &
    python examples/transparent/pydantic_ai_agent.py --base-url http://127.0.0.1:8000/v1

One conversation, three questions; each makes the agent call ``lookup_order`` (a 1.5 s lookup)
once, then answer from its result. The model is an ``OpenAIChatModel`` with an ``OpenAIProvider``
on the server's base URL; ``tokencake serve`` recognises its tool-call turns on its own
(transparent mode).

The bundled 135M model cannot decide to call a tool by itself, so the agent's per-step model
settings (``step_settings``) force the call on a question's first request (``tool_choice`` naming
``lookup_order``; the only tool, so Pydantic AI sends ``"required"``) and turn tools off
(``"none"``) once the tool answered; a capable model needs neither.
"""

from __future__ import annotations

import argparse
import asyncio

from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import ModelMessage, ModelRequest, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

INSTRUCTIONS = "You are a support agent. Look orders up with the lookup_order tool, then answer in one line."
QUESTIONS = ("Where is order 42?", "And order 7?", "And order 13?")
TOOL_SECONDS = 1.5

tool_calls = 0


async def lookup_order(order_id: str) -> str:
    """Look up an order's shipping status.

    Args:
        order_id: the order number.
    """
    global tool_calls
    tool_calls += 1
    await asyncio.sleep(TOOL_SECONDS)
    return f"order {order_id}: shipped yesterday, arrives tomorrow"


def step_settings(ctx: RunContext[None]) -> ModelSettings:
    """``lookup_order`` forced until a tool answered, then ``"none"``."""
    last = ctx.messages[-1] if ctx.messages else None
    answered = isinstance(last, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in last.parts)
    return ModelSettings(max_tokens=64, temperature=0.0, tool_choice="none" if answered else ["lookup_order"])


async def chat(base_url: str, model: str, api_key: str) -> list[str]:
    """The conversation: each question continues the previous run's messages."""
    provider = OpenAIProvider(base_url=base_url, api_key=api_key)
    agent = Agent(
        OpenAIChatModel(model, provider=provider),
        instructions=INSTRUCTIONS,
        tools=[lookup_order],
        model_settings=step_settings,
    )
    answers: list[str] = []
    history: list[ModelMessage] = []
    for question in QUESTIONS:
        result = await agent.run(question, message_history=history)
        answers.append(result.output)
        history = result.all_messages()
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
