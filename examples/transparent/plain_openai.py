"""A plain ``openai`` client tool loop, no TokenCake import (docs/transparent.md).

    tokencake serve &
    python examples/transparent/plain_openai.py --base-url http://127.0.0.1:8000/v1

One conversation, three questions; each makes the model call ``lookup_order`` (a 1.5 s lookup)
once, then answer from its result. ``tokencake serve`` recognises the tool-call turns on its own
(transparent mode) and parks the conversation's KV cache while the tool runs.

The bundled 135M model cannot decide to call a tool by itself, so the loop forces the call on a
question's first request (a named ``tool_choice``) and turns tools off (``"none"``) once the tool
answered; a capable model needs neither.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import openai

INSTRUCTIONS = "You are a support agent. Look orders up with the lookup_order tool, then answer in one line."
QUESTIONS = ("Where is order 42?", "And order 7?", "And order 13?")
TOOL_SECONDS = 1.5
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Look up an order's shipping status.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "description": "the order number"}},
                "required": ["order_id"],
            },
        },
    }
]
FORCED = {"type": "function", "function": {"name": "lookup_order"}}

tool_calls = 0


def lookup_order(order_id: str) -> str:
    """Look up an order's shipping status (a slow backend)."""
    global tool_calls
    tool_calls += 1
    time.sleep(TOOL_SECONDS)
    return f"order {order_id}: shipped yesterday, arrives tomorrow"


def ask(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], question: str) -> str:
    """One question of the conversation: tool calls until the model answers; ``messages`` grows."""
    messages.append({"role": "user", "content": question})
    answered = False
    while True:
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            tool_choice="none" if answered else FORCED,
            max_tokens=64,
            temperature=0.0,
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            messages.append({"role": "assistant", "content": message.content or ""})
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            result = lookup_order(str(args.get("order_id", "")))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        answered = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key", default="EMPTY")
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}]
    for question in QUESTIONS:
        print(ask(client, args.model, messages, question))
    print(f"tool calls: {tool_calls}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
