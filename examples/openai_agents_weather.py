"""An OpenAI Agents SDK agent on a TokenCake server (docs/integrations.md, "openai_agents").

    python examples/openai_agents_weather.py             # against TOKENCAKE_BASE_URL (tokencake serve)
    python examples/openai_agents_weather.py --offline   # on tc.testing's scripted server

Every chat completion of the conversation carries its session, and each get_weather call is
bracketed by stall_begin / stall_end, so the server can park the conversation's KV cache meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import agents
import openai
from agents import Agent, Runner, function_tool

import tokencake as tc
from tokencake.integrations.openai_agents import instrument

MODEL = os.environ.get("TOKENCAKE_MODEL", "smollm2-135m-instruct")


# --8<-- [start:agent]
@function_tool
async def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


async def chat(session: tc.Session, client: openai.AsyncOpenAI | None = None) -> list[str]:
    """Two turns of one conversation; ``session`` is that conversation (reuse it every turn)."""
    agent = instrument(
        Agent(name="weather", tools=[get_weather]),
        session,
        model=MODEL,
        client=client,  # default: tc.openai_client(session), on the session's server
        predicted_s={"get_weather": 1.0},
    )
    first = await Runner.run(agent, "What is the weather in Paris?")
    follow_up = [*first.to_input_list(), {"role": "user", "content": "And in Rome?"}]
    second = await Runner.run(agent, follow_up)
    return [first.final_output, second.final_output]


# --8<-- [end:agent]


# --8<-- [start:test]
def weather_script(req: tc.ScriptedRequest) -> str | tc.ToolCall:
    """The model's part: call get_weather for the asked city, then answer from its result."""
    if req.tool_results:
        return f"It is {req.tool_results[-1]}."
    city = "Rome" if "Rome" in req.prompt else "Paris"
    return tc.ToolCall(f"call-{req.index}", "get_weather", {"city": city})


async def test_chat_offline() -> None:
    server = tc.testing.ScriptedTransport(weather_script)
    stalls = tc.StallRecorder()
    session = tc.Session("chat-42", events_url=False, hooks=stalls)
    answers = await chat(session, client=server.openai_client(session))
    assert answers == ["It is sunny in Paris.", "It is sunny in Rome."]
    assert [r["kv_transfer_params"]["tokencake"]["turn"] for r in server.requests] == [0, 1, 2, 3]
    pairs = tc.testing.closed_pairs(stalls)  # one stall_begin / stall_end pair per tool call
    assert [(begin.tool, end.outcome) for begin, end in pairs] == [("get_weather", "ok")] * 2


# --8<-- [end:test]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offline", action="store_true", help="run on tc.testing's scripted server")
    args = parser.parse_args(argv)
    # The SDK exports traces to OpenAI (and warns without OPENAI_API_KEY): keep them local here.
    agents.set_tracing_disabled(True)
    if args.offline:
        asyncio.run(test_chat_offline())
        print("offline: 4 stamped requests, 2 closed stalls")
        return 0
    for answer in asyncio.run(chat(tc.Session(node="weather"))):
        print(answer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
