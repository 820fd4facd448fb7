"""Forced tool choice on a real server: the share of schema-valid tool calls over N forced turns.

Each turn sends one chat completion with ``tools`` and a forced choice over 25 different requests
(one to three tools; strings, enums, numbers, bounded integers, arrays, nested objects): turns
0-24 force with ``tool_choice="required"``, turns 25-49 name the function, and so on. A turn is
valid when the reply holds at least one tool call, every call names an offered tool (the named one
when named), and every call's arguments parse as a JSON object valid under that tool's schema.

By default it starts ``tokencake serve``'s server with default flags (``Server()``: the bundled
model, default dtype, default tool-calling flags) and stops it afterwards; ``--base-url`` targets a
running server instead. Extra vLLM arguments go after ``--``.

    .venv/bin/python benchmarks/forced_tool_calls.py --turns 50 --json out.json
    .venv/bin/python benchmarks/forced_tool_calls.py --base-url http://127.0.0.1:8000/v1

Prints one line per failed turn, a summary and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
import jsonschema


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    params = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


WEATHER = _fn(
    "get_weather",
    "Current weather of a city.",
    {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    ["city"],
)
SEARCH = _fn(
    "search_web",
    "Search the web.",
    {
        "query": {"type": "string"},
        "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
    },
    ["query", "max_results"],
)
EVENT = _fn(
    "create_event",
    "Put an event in the calendar.",
    {
        "title": {"type": "string"},
        "day": {"type": "string", "enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
        "attendees": {"type": "array", "items": {"type": "string"}},
    },
    ["title", "day", "attendees"],
)
CALC = _fn(
    "calculate",
    "Apply an arithmetic operation to two numbers.",
    {
        "a": {"type": "number"},
        "b": {"type": "number"},
        "op": {"type": "string", "enum": ["add", "subtract", "multiply", "divide"]},
    },
    ["a", "b", "op"],
)
ORDER = _fn(
    "place_order",
    "Order an item for delivery.",
    {
        "item": {"type": "string"},
        "quantity": {"type": "integer", "minimum": 1},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
        },
    },
    ["item", "quantity", "address"],
)

EMAIL = _fn(
    "send_email",
    "Send an email.",
    {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
    ["to", "subject", "body"],
)
TRANSLATE = _fn(
    "translate",
    "Translate a text into another language.",
    {
        "text": {"type": "string"},
        "target": {"type": "string", "enum": ["english", "french", "german", "spanish"]},
    },
    ["text", "target"],
)

#: (tools offered, the tool a named turn forces, prompt): 25 different requests.
CASES: list[tuple[list[dict[str, Any]], str, str]] = [
    ([WEATHER], "get_weather", "What is the weather in Paris?"),
    ([WEATHER, SEARCH], "search_web", "Find me three articles about sourdough bread."),
    ([CALC], "calculate", "What is 17 times 23?"),
    ([EVENT, WEATHER], "create_event", "Book a team lunch on Friday with Ana and Bo."),
    ([ORDER], "place_order", "Send two boxes of green tea to 5 Main Street, Springfield."),
    ([SEARCH, CALC, WEATHER], "get_weather", "Is it going to rain in Tokyo?"),
    ([CALC, SEARCH], "calculate", "Divide 144 by 12 for me."),
    ([EVENT], "create_event", "Schedule a design review on Tuesday with the whole team."),
    ([SEARCH], "search_web", "Who won the 2018 football world cup?"),
    ([ORDER, SEARCH], "place_order", "I need five notebooks delivered to 12 Oak Road in Leeds."),
    ([EMAIL], "send_email", "Email bob@example.com that the meeting moved to 3 pm."),
    ([TRANSLATE], "translate", "How do you say good morning in French?"),
    ([WEATHER, EMAIL], "get_weather", "Should I take an umbrella in London today?"),
    ([CALC, TRANSLATE], "calculate", "Subtract 45 from 200."),
    ([SEARCH, EMAIL], "send_email", "Tell alice@example.com I will be late, subject: delay."),
    ([TRANSLATE, SEARCH], "translate", "Translate 'thank you very much' to German."),
    ([EVENT, EMAIL], "create_event", "Plan a birthday party for Carla on Wednesday."),
    ([ORDER, CALC], "place_order", "Order one laptop stand to 9 Elm Street, Boston."),
    ([WEATHER], "get_weather", "How hot is it in Madrid in fahrenheit?"),
    ([SEARCH, TRANSLATE], "search_web", "Look up the population of Canada, two results please."),
    ([CALC], "calculate", "Add 3.5 and 4.25."),
    ([EMAIL, EVENT, SEARCH], "send_email", "Write to the team@example.com list about Monday's demo."),
    ([TRANSLATE, WEATHER], "translate", "Please translate 'where is the station' into Spanish."),
    ([EVENT, CALC], "create_event", "Set up a one-on-one with Dana on Thursday."),
    ([ORDER, EMAIL, WEATHER], "place_order", "Buy three packs of coffee, deliver to 1 Bay Road, Sydney."),
]


def turn_request(i: int, model: str, max_tokens: int = 128) -> dict[str, Any]:
    """Chat-completion body of forced turn ``i``: the case ``i % 25``, ``required`` in the first
    round of cases and the named tool in the second (and so on alternately)."""
    tools, named, prompt = CASES[i % len(CASES)]
    required = (i // len(CASES)) % 2 == 0
    choice: Any = "required" if required else {"type": "function", "function": {"name": named}}
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "tools": tools,
        "tool_choice": choice,
        "temperature": 0.0,
        "max_tokens": max_tokens,
    }


def check_reply(request: dict[str, Any], reply: dict[str, Any]) -> str | None:
    """None when ``reply`` holds only schema-valid calls of the offered (or named) tools; else why not."""
    message = reply["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    if not calls:
        finish = reply["choices"][0].get("finish_reason")
        return f"no tool call (finish_reason={finish}, content={str(message.get('content'))[:80]!r})"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in request["tools"]}
    choice = request["tool_choice"]
    for call in calls:
        name = call["function"]["name"]
        if name not in schemas:
            return f"unknown tool {name!r}"
        if isinstance(choice, dict) and name != choice["function"]["name"]:
            return f"called {name!r}, not the named {choice['function']['name']!r}"
        try:
            args = json.loads(call["function"]["arguments"])
        except ValueError:
            return f"{name}: arguments are not JSON: {call['function']['arguments'][:80]!r}"
        try:
            jsonschema.validate(args, schemas[name])
        except jsonschema.ValidationError as exc:
            return f"{name}: {exc.message[:100]} in {json.dumps(args)[:80]}"
    return None


def run(base_url: str, model: str, turns: int, api_key: str | None = None) -> dict[str, Any]:
    """Send ``turns`` forced turns one after another; count schema-valid replies."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    failures: list[dict[str, Any]] = []
    calls = 0
    started = time.monotonic()
    with httpx.Client(base_url=base_url, headers=headers, timeout=300.0) as client:
        for i in range(turns):
            body = turn_request(i, model)
            resp = client.post("/chat/completions", json=body)
            if resp.status_code != 200:
                failures.append({"turn": i, "why": f"HTTP {resp.status_code}: {resp.text[:160]}"})
                continue
            reply = resp.json()
            calls += len(reply["choices"][0]["message"].get("tool_calls") or [])
            why = check_reply(body, reply)
            if why is not None:
                failures.append({"turn": i, "why": why})
    elapsed = time.monotonic() - started
    return {
        "turns": turns,
        "valid": turns - len(failures),
        "valid_share": (turns - len(failures)) / turns if turns else 0.0,
        "tool_calls": calls,
        "seconds": round(elapsed, 1),
        "failures": failures,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=50, help="forced turns (default 50)")
    p.add_argument("--base-url", help="OpenAI base URL of a running server (default: start one)")
    p.add_argument("--model", help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", help="API key of a running server")
    p.add_argument("--json", dest="json_path", help="also write the result here")
    args = p.parse_args(argv)

    server = None
    base_url = args.base_url
    if base_url is None:
        from tokencake.serving import Server

        server = Server(port=0, extra_args=vllm_args, progress=True)
        server.start()
        base_url = server.base_url
    try:
        model = args.model or httpx.get(base_url + "/models", timeout=10).json()["data"][0]["id"]
        result = run(base_url, model, args.turns, args.api_key)
        if server is not None:
            result["vllm_args"] = server.vllm_args()
    finally:
        if server is not None:
            server.stop()
    for failure in result["failures"]:
        print(f"turn {failure['turn']}: {failure['why']}")
    print(
        f"{result['valid']}/{result['turns']} forced turns schema-valid "
        f"({100 * result['valid_share']:.0f} %), {result['tool_calls']} tool calls, {result['seconds']} s"
    )
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(result, fh, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k not in ("failures", "vllm_args")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
