"""An OpenAI Agents SDK agent on any OpenAI-compatible server, no TokenCake import (docs/transparent.md).

    tokencake serve &
    python examples/transparent/openai_agents.py --base-url http://127.0.0.1:8000/v1

One conversation, three questions; each makes the agent call ``lookup_order`` (a 1.5 s lookup)
once, then answer from its result. The agent talks Chat Completions (``OpenAIChatCompletionsModel``
on an ``AsyncOpenAI`` client with the server's base URL); ``tokencake serve`` recognises its
tool-call turns on its own (transparent mode). Tracing is turned off: the SDK would export traces
to OpenAI's platform.

The bundled 135M model cannot decide to call a tool by itself, so ``ForcedToolModel`` forces the
call on a question's first request (a named ``tool_choice``) and turns tools off (``"none"``)
once the tool answered; a capable model needs neither (use ``OpenAIChatCompletionsModel``).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from agents import (
    Agent,
    ModelResponse,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    TResponseInputItem,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

INSTRUCTIONS = "You are a support agent. Look orders up with the lookup_order tool, then answer in one line."
QUESTIONS = ("Where is order 42?", "And order 7?", "And order 13?")
TOOL_SECONDS = 1.5

tool_calls = 0


@function_tool
async def lookup_order(order_id: str) -> str:
    """Look up an order's shipping status.

    Args:
        order_id: the order number.
    """
    global tool_calls
    tool_calls += 1
    await asyncio.sleep(TOOL_SECONDS)
    return f"order {order_id}: shipped yesterday, arrives tomorrow"


class ForcedToolModel(OpenAIChatCompletionsModel):
    """Chat Completions with ``lookup_order`` forced until a tool answered, then ``"none"``."""

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        *args: Any,
        **kwargs: Any,
    ) -> ModelResponse:
        last = input[-1] if isinstance(input, list) and input else {}
        answered = isinstance(last, dict) and last.get("type") == "function_call_output"
        choice = "none" if answered else "lookup_order"
        settings = model_settings.resolve(ModelSettings(tool_choice=choice))
        return await super().get_response(system_instructions, input, settings, *args, **kwargs)


async def chat(base_url: str, model: str, api_key: str) -> list[str]:
    """The conversation: each question continues the previous run's items."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    agent = Agent(
        name="support",
        instructions=INSTRUCTIONS,
        tools=[lookup_order],
        model=ForcedToolModel(model=model, openai_client=client),
        model_settings=ModelSettings(max_tokens=64, temperature=0.0),
    )
    answers: list[str] = []
    items: list[TResponseInputItem] = []
    for question in QUESTIONS:
        result = await Runner.run(agent, [*items, {"role": "user", "content": question}])
        answers.append(str(result.final_output))
        items = result.to_input_list()
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key", default="EMPTY")
    args = parser.parse_args(argv)
    set_tracing_disabled(True)  # no trace export to OpenAI's platform
    for answer in asyncio.run(chat(args.base_url, args.model, args.api_key)):
        print(answer)
    print(f"tool calls: {tool_calls}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
