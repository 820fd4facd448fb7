"""TokenCake quick start: two agents work in parallel, each calling a tool, and a third joins them.

    python examples/quickstart.py --scripted     # offline, deterministic model (no server)
    python examples/quickstart.py                # against TOKENCAKE_BASE_URL (default :8000/v1)

Each tool call is bracketed by stall_begin/stall_end events; against a TokenCake server
(``tokencake serve``) they reach its events listener, so the agents' KV cache can leave the GPU
while the tools run.
"""

from __future__ import annotations

import argparse
import sys
import time

import anyio

import tokencake as tc

app = tc.App("trip", inputs=["city"], description="Plan a day out from the weather and local events.")

_WEATHER = {"paris": "light rain, 14 °C", "lisbon": "sunny, 22 °C", "oslo": "snow, -3 °C"}
_EVENTS = {
    "paris": ["Louvre late opening", "jazz at Le Duc des Lombards", "Seine boat tour"],
    "lisbon": ["tram 28 ride", "fado night in Alfama", "LX Factory market"],
    "oslo": ["Munch museum", "sauna by the fjord", "Holmenkollen ski jump"],
}


@app.tool(predict_time=0.5, kind="api")
async def weather(city: str) -> str:
    """Current weather of a city.

    Args:
        city: the city name.
    """
    await anyio.sleep(0.5)  # a remote API call
    return _WEATHER.get(city.lower(), "unknown")


@app.tool(predict_time=0.8, kind="search")
def local_events(city: str, limit: int = 2) -> list[str]:
    """Things to do today in a city.

    Args:
        city: the city name.
        limit: how many events to return.
    """
    time.sleep(0.8)  # a blocking search: runs in a worker thread
    return _EVENTS.get(city.lower(), [])[:limit]


@app.agent(system="You are a concise weather reporter.", max_tokens=60, calls=[weather])
async def forecaster(ctx: tc.Context, inputs: dict[str, object]) -> str:
    report = await ctx.call(weather, city=ctx.inputs["city"])
    reply = await ctx.llm(f"Weather in {ctx.inputs['city']}: {report}. Say in one sentence what to wear.")
    return reply.text


@app.agent(system="You are a local guide.", max_tokens=60, calls=[local_events])
async def scout(ctx: tc.Context, inputs: dict[str, object]) -> str:
    events = await ctx.call(local_events, city=ctx.inputs["city"], limit=2)
    reply = await ctx.llm(
        f"Events today in {ctx.inputs['city']}: {events}. Pick the best one, in one sentence."
    )
    return reply.text


@app.agent(system="You plan days out.", max_tokens=120, after=[forecaster, scout])
async def planner(ctx: tc.Context, inputs: dict[str, object]) -> str:
    reply = await ctx.llm(
        f"Weather advice: {inputs['forecaster']}\nBest event: {inputs['scout']}\n"
        f"Write a two-sentence plan for a day in {ctx.inputs['city']}."
    )
    return reply.text


def scripted_reply(req: tc.ScriptedRequest) -> str:
    """Deterministic stand-in for a model: answers from the prompt it receives."""
    if req.node == "forecaster":
        return f"It is {req.prompt.split(': ', 1)[1].split('.')[0]}, so dress for it."
    if req.node == "scout":
        best = req.prompt.split("[", 1)[-1].split(",")[0].strip("'] ")
        return f"Go for the {best}."
    notes = dict(line.split(": ", 1) for line in req.prompt.splitlines() if ": " in line)
    return f"{notes.get('Weather advice', '')} Then: {notes.get('Best event', 'rest')}".strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripted", action="store_true", help="use the offline ScriptedLLM")
    parser.add_argument("--city", default="Lisbon")
    args = parser.parse_args(argv)
    llm = tc.ScriptedLLM(scripted_reply, token_delay=0.005) if args.scripted else tc.LLM()
    try:
        result = app.run_sync(llm=llm, city=args.city, timeout=600)
    except tc.NodeFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(result.output)
    print()
    print(result.timings_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
