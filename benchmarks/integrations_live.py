"""Each framework adapter's example against a running ``tokencake serve`` (issue 13, point 3).

Runs the examples of docs/integrations.md -- OpenAI Agents SDK (``instrument``), LangChain/LangGraph
(``TokenCakeMiddleware`` on ``create_agent``), Pydantic AI (the ``TokenCake`` capability) -- as one
short conversation each: two user turns, each asking for one call of a ``lookup_order`` tool that
takes ``--tool-seconds``. For every adapter it prints the chat requests the client sent (and the
session ids / turns they carried), the stall pairs the adapter sent, and the server's ``/v1/stats``
counters before and after (``events.stall_begin``, ``events.stall_end``, ``requests.with_meta``,
``acks.*``, offload / prefetch). Adapters whose library is not installed are skipped.

    tokencake serve &                                   # or any TokenCake server
    .venv/bin/python benchmarks/integrations_live.py --base-url http://127.0.0.1:8000/v1
    .venv/bin/python benchmarks/integrations_live.py --base-url ... --only langgraph --force-tool

``--force-tool`` sets ``tool_choice`` to ``required`` on a turn's first request and to ``none`` once
the tool answered, for a model too small to call the tool on its own (it needs a server with tool
calling, issue 13 point 1). Exit status 1 when an adapter failed or the server's counters do not
match what the adapters sent (run it on an otherwise idle server: the counters are global).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

import tokencake as tc
from tokencake.events import STATS_PATH

QUESTIONS = (
    "Where is order 42? Use the lookup_order tool.",
    "And order 7? Use the lookup_order tool again.",
)
INSTRUCTIONS = "You are a support agent. Look orders up with the lookup_order tool, then answer in one line."
COUNTERS = (
    "events.stall_begin",
    "events.stall_end",
    "requests.with_meta",
    "offload.jobs",
    "prefetch.jobs",
    "demand_load.requests",
    "next_turn.requests",
)


@dataclass
class Config:
    base_url: str
    model: str
    api_key: str | None
    events_url: str | bool | None
    tool_seconds: float
    force_tool: bool
    timeout: float = 300.0
    #: Set on requests that name no output bound (the bundled 135M model can ramble past its 4k context).
    max_tokens: int | None = 256


@dataclass
class Report:
    adapter: str
    output: str = ""
    error: str | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    pairs: list[tuple[Any, Any]] = field(default_factory=list)
    before: dict[str, float] | None = None
    after: dict[str, float] | None = None

    def delta(self, key: str) -> float | None:
        if self.before is None or self.after is None:
            return None
        return self.after.get(key, 0) - self.before.get(key, 0)

    def problems(self) -> list[str]:
        if self.error:
            return [self.error]
        found = []
        stamped = [r for r in self.requests if r["session_id"]]
        if len(stamped) != len(self.requests) or not self.requests:
            found.append(
                f"{len(self.requests) - len(stamped)} of {len(self.requests)} chat requests had no session"
            )
        if not self.pairs:
            found.append("no tool call, so no stall (try --force-tool)")
        if any(end is None for _, end in self.pairs):
            found.append("a stall has no stall_end")
        expected = {
            "events.stall_begin": len(self.pairs),
            "events.stall_end": len(self.pairs),
            "requests.with_meta": len(stamped),
        }
        for key, want in expected.items():
            got = self.delta(key)
            if got is not None and got != want:
                found.append(f"server {key} +{got:g}, the adapter sent {want}")
        return found


class Probe(httpx.AsyncBaseTransport):
    """The innermost transport: records each chat request as sent, optionally forces the tool and
    bounds the output of requests that set no bound."""

    def __init__(
        self,
        force_tool: bool,
        transport: httpx.AsyncBaseTransport | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.force_tool = force_tool
        self.max_tokens = max_tokens
        self.bodies: list[dict[str, Any]] = []
        self._transport = transport or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path.endswith("/chat/completions"):
            body = json.loads(await request.aread())
            if self.force_tool and body.get("tools"):
                answered = (body.get("messages") or [{}])[-1].get("role") == "tool"
                body["tool_choice"] = "none" if answered else "required"
            if self.max_tokens and not (body.get("max_tokens") or body.get("max_completion_tokens")):
                body["max_tokens"] = self.max_tokens
            self.bodies.append(body)
            headers = httpx.Headers(request.headers)
            headers.pop("content-length", None)
            request = httpx.Request(
                request.method,
                request.url,
                headers=headers,
                content=json.dumps(body).encode(),
                extensions=request.extensions,
            )
        return await self._transport.handle_async_request(request)

    async def aclose(self) -> None:
        await self._transport.aclose()


def order_tool(seconds: float) -> Callable[[str], Awaitable[str]]:
    """The conversation's tool: a lookup that takes ``seconds`` (what the server parks KV for)."""

    async def lookup_order(order_id: str) -> str:
        """Look up an order's shipping status.

        Args:
            order_id: the order number.
        """
        await asyncio.sleep(seconds)
        return f"order {order_id}: shipped yesterday, arrives tomorrow"

    return lookup_order


async def run_openai_agents(cfg: Config, probe: Probe, rec: tc.StallRecorder) -> str:
    import agents
    from agents import Agent, Runner, function_tool

    from tokencake.integrations.openai_agents import instrument

    agents.set_tracing_disabled(True)  # no trace export to api.openai.com
    session = tc.Session(
        node="support", base_url=cfg.base_url, events_url=cfg.events_url, api_key=cfg.api_key, hooks=rec
    )
    client = tc.openai_client(session, base_url=cfg.base_url, api_key=cfg.api_key, transport=probe)
    agent = Agent(
        name="support", instructions=INSTRUCTIONS, tools=[function_tool(order_tool(cfg.tool_seconds))]
    )
    agent = instrument(agent, session, model=cfg.model, client=client, predicted_s=cfg.tool_seconds)
    first = await Runner.run(agent, QUESTIONS[0])
    second = await Runner.run(agent, [*first.to_input_list(), {"role": "user", "content": QUESTIONS[1]}])
    return f"{first.final_output} | {second.final_output}"


async def run_langgraph(cfg: Config, probe: Probe, rec: tc.StallRecorder) -> str:
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.checkpoint.memory import InMemorySaver

    from tokencake.integrations.langgraph import TokenCakeMiddleware

    tk = TokenCakeMiddleware(
        predicted_s=cfg.tool_seconds,
        base_url=cfg.base_url,
        events_url=cfg.events_url,
        api_key=cfg.api_key,
        hooks=rec,
    )
    model = ChatOpenAI(
        model=cfg.model,
        base_url=cfg.base_url,
        api_key=cfg.api_key or "EMPTY",
        http_async_client=httpx.AsyncClient(transport=probe, timeout=cfg.timeout),
    )
    agent = create_agent(
        model,
        [tool(order_tool(cfg.tool_seconds))],
        middleware=[tk],
        name="support",
        system_prompt=INSTRUCTIONS,
        checkpointer=InMemorySaver(),
    )
    config = {"configurable": {"thread_id": f"live-{uuid.uuid4().hex[:8]}"}}
    answers = []
    for question in QUESTIONS:
        out = await agent.ainvoke({"messages": [{"role": "user", "content": question}]}, config)
        answers.append(str(out["messages"][-1].content))
    return " | ".join(answers)


async def run_pydantic_ai(cfg: Config, probe: Probe, rec: tc.StallRecorder) -> str:
    import openai
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from tokencake.integrations.pydantic_ai import TokenCake

    client = openai.AsyncOpenAI(
        base_url=cfg.base_url,
        api_key=cfg.api_key or "EMPTY",
        http_client=httpx.AsyncClient(transport=probe, timeout=cfg.timeout),
    )
    capability = TokenCake(
        predicted_s=cfg.tool_seconds,
        base_url=cfg.base_url,
        events_url=cfg.events_url,
        api_key=cfg.api_key,
        hooks=rec,
    )
    model = OpenAIChatModel(cfg.model, provider=OpenAIProvider(openai_client=client))
    agent = Agent(
        model,
        name="support",
        instructions=INSTRUCTIONS,
        tools=[order_tool(cfg.tool_seconds)],
        capabilities=[capability],
    )
    first = await agent.run(QUESTIONS[0])
    second = await agent.run(QUESTIONS[1], message_history=first.all_messages())
    return f"{first.output} | {second.output}"


ADAPTERS: dict[str, tuple[str, Callable[[Config, Probe, tc.StallRecorder], Awaitable[str]]]] = {
    "openai_agents": ("agents", run_openai_agents),
    "langgraph": ("langchain.agents", run_langgraph),
    "pydantic_ai": ("pydantic_ai", run_pydantic_ai),
}


def server_stats(cfg: Config) -> dict[str, float] | None:
    events_url = tc.Session("probe", base_url=cfg.base_url, events_url=cfg.events_url).events_url
    if not events_url:
        return None
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        response = httpx.get(events_url + STATS_PATH, headers=headers, timeout=5.0)
        response.raise_for_status()
        counters = response.json().get("counters", {})
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        print(f"  (GET {events_url}{STATS_PATH} failed: {exc})", file=sys.stderr)
        return None
    return {k: float(v) for k, v in counters.items() if isinstance(v, int | float)}


async def run_adapter(
    name: str, cfg: Config, transport: httpx.AsyncBaseTransport | None = None, with_stats: bool = True
) -> Report:
    """One adapter's conversation; ``transport`` replaces the network (offline smoke tests)."""
    import importlib.util

    report = Report(name)
    module, run = ADAPTERS[name]
    try:
        available = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        available = False
    if not available:
        report.error = (
            f"skipped: {module} is not installed (pip install 'tokencake[{name.replace('_', '-')}]')"
        )
        return report
    probe = Probe(cfg.force_tool, transport, max_tokens=cfg.max_tokens)
    rec = tc.StallRecorder()
    report.before = server_stats(cfg) if with_stats else None
    try:
        report.output = await run(cfg, probe, rec)
    except Exception as exc:  # report it, go on with the next adapter
        report.error = f"{type(exc).__name__}: {exc}"[:500]
    await asyncio.sleep(0.2)  # let the last stall_end reach the server's counters
    report.after = server_stats(cfg) if with_stats else None
    report.pairs = rec.pairs()
    for body in probe.bodies:
        meta = (body.get("kv_transfer_params") or {}).get("tokencake") or {}
        report.requests.append(
            {"session_id": meta.get("session_id"), "turn": meta.get("turn"), "priority": body.get("priority")}
        )
    return report


def print_report(report: Report) -> None:
    print(f"\n== {report.adapter}")
    if report.error and report.error.startswith("skipped"):
        print(f"  {report.error}")
        return
    print(f"  answer: {report.output[:300]!r}")
    sessions = sorted({str(r["session_id"]) for r in report.requests})
    print(f"  chat requests: {len(report.requests)} · sessions: {', '.join(sessions) or '-'}")
    turns = [r["turn"] for r in report.requests]
    priorities = sorted({str(r["priority"]) for r in report.requests})
    print(f"  turns: {turns} · priorities: {priorities}")
    for begin, end in report.pairs:
        outcome = end.outcome if end is not None else "NO END"
        took = f"{end.duration_s:.2f} s" if end is not None else "-"
        print(f"  stall {begin.stall_id}: {begin.tool} on {begin.session_id} -> {outcome} ({took})")
    if report.before is not None and report.after is not None:
        keys = [*COUNTERS, *sorted(k for k in report.after if k.startswith(("acks.", "stalls.decision.")))]
        moved = {k: report.delta(k) for k in keys if report.delta(k)}
        print("  server /v1/stats: " + (", ".join(f"{k} +{v:g}" for k, v in moved.items()) or "no change"))
    else:
        print("  server /v1/stats: unavailable")
    for problem in report.problems():
        print(f"  PROBLEM: {problem}")


def resolve_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=10.0)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base-url", default=os.environ.get("TOKENCAKE_BASE_URL", "http://127.0.0.1:8000/v1")
    )
    parser.add_argument(
        "--events-url", help="the extension's events URL (default: port + 1 of a loopback --base-url)"
    )
    parser.add_argument("--api-key", default=os.environ.get("TOKENCAKE_API_KEY"))
    parser.add_argument("--model", help="served model name (default: the first one the server lists)")
    parser.add_argument(
        "--tool-seconds", type=float, default=1.0, help="how long lookup_order takes (default 1.0)"
    )
    parser.add_argument("--force-tool", action="store_true", help="force one tool call per turn (see above)")
    parser.add_argument("--only", choices=sorted(ADAPTERS), action="append", help="run only these adapters")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="output bound set on requests that name none (default 256; 0 = leave them unbounded)",
    )
    args = parser.parse_args(argv)
    model = args.model or resolve_model(args.base_url, args.api_key)
    cfg = Config(
        args.base_url,
        model,
        args.api_key,
        args.events_url,
        args.tool_seconds,
        args.force_tool,
        max_tokens=args.max_tokens or None,
    )
    events_url = tc.Session("probe", base_url=cfg.base_url, events_url=cfg.events_url).events_url
    print(f"server {cfg.base_url} · model {model} · events {events_url}")
    failed = False
    for name in args.only or list(ADAPTERS):
        started = time.perf_counter()
        report = asyncio.run(run_adapter(name, cfg))
        print_report(report)
        print(f"  ({time.perf_counter() - started:.1f} s)")
        skipped = bool(report.error and report.error.startswith("skipped"))
        failed |= bool(report.problems()) and not skipped
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
