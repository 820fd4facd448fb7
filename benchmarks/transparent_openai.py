"""Transparent mode vs stock vLLM vs the SDK path, on agents written with the plain openai client.

Issue 48's acceptance: a workload written with the plain ``openai`` client only (several concurrent
agents, tools forced, KV pressure), run on stock vLLM, on an extension server in transparent mode,
and through the SDK path, in >= 3 interleaved rounds; transparent mode must recover >= 80 % of the
SDK path's gain over stock: recovered = (stock - transparent) / (stock - sdk) on mean agent time.

The workload, drawn afresh each round from ``--seed`` (default: a random seed, recorded) and
identical on every system of a round: ``--agents`` agents (8)
start within ``start_spread_s`` of each other; each is one ``openai.AsyncOpenAI`` tool loop on a
system prompt shared by all agents (plus the same tool list) and a private document of a few
hundred to ~1.5k tokens. It makes 3-5 tool turns (``--turns``), each forcing a named function
(``tool_choice={"type": "function", ...}``; schema-valid on the bundled model through the server's
tool-call parser), runs the tool as a seeded lognormal sleep (median 3 s, 1-8 s), appends the
result, and ends with one answer turn (``tool_choice="none"``, ``ignore_eos``). Greedy decoding,
small ``max_tokens``. The device KV (40 blocks of 128 tokens, as the bench's stress preset) holds
a few agents' contexts, not all of them.

Systems, each a fresh ``tokencake.serving.Server`` started with the bench's ``baseline`` /
``tokencake`` settings (same model, flags and device KV; extension servers add a host pool):

=============== ==================================================================================
``stock``       stock vLLM (``baseline=True``), the plain loop
``transparent`` extension server in transparent mode (``transparent=True``), the plain loop: the
                client sends no TokenCake metadata and no stall events
``sdk``         extension server with ``transparent=False``; the same loop, each request with
                ``tc.Session.request_metadata()`` as ``extra_body`` and each tool call inside
                ``tc.stall(session, tool, predicted_s=<the median>)``: the SDK's public API
=============== ==================================================================================

Each round runs every system once, in a seeded order from a Latin square (every system once in
every position per block of rounds). Recorded per run: makespan, mean / p50 / p90 agent time, HTTP
errors, vLLM's prompt tokens by source (computed, device prefix hits, loaded from host), the
extension's ``/v1/stats`` (stalls begun, next-turn prefix device / host / recomputed), and the
equal-work check over the systems of each round. Reported: per-round transparent/stock and
sdk/stock with a 95 % t interval over rounds, and recovered with a delta-method interval.

    python benchmarks/transparent_openai.py --quick --out /tmp/tq   # plumbing: ~5 min on 2 cores
    python benchmarks/transparent_openai.py                         # the acceptance run: ~40 min

The script imports ``tokencake`` from the environment: to measure a checkout other than the one
installed in the venv, put it first (``PYTHONPATH=. python benchmarks/transparent_openai.py``).
The full run is an estimate for 2 idle cores: 9 server starts of ~1 min, and 9 runs of ~40 chat
completions on 1-3k-token prompts, the size of the stress preset's ~2.5 min per system.
``--quick`` (2 agents, 2 tool turns, 1 round, 32 device blocks) checks the plumbing only: its KV
is barely under pressure. The stock and transparent agents import nothing from TokenCake; the
script uses ``tokencake.bench`` to start servers and to measure.

Writes ``<out>-results.json`` (every number, the workload plans, seeds, provenance) and
``<out>-summary.md``; the default ``--out`` is ``docs/bench/transparent-openai``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import math
import random
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
from transparent_openai_report import aggregate, markdown, summarize_run  # type: ignore[import-not-found]

from tokencake.bench.environment import loadavg, machine, utc_now, versions
from tokencake.bench.equal_work_check import equal_work
from tokencake.bench.presets import CPU_BLOCK_TOKENS
from tokencake.bench.replay import WARMUP_PROMPT
from tokencake.bench.rounds import balanced_orders, hash_seed
from tokencake.bench.synthetic import MultiTurnSpec, document, words
from tokencake.bench.systems import SYSTEMS, ServerConfig, server_kwargs
from tokencake.events import STATS_PATH
from tokencake.serving.prometheus import parse_metrics

#: System name -> (the bench system whose server settings it runs, its ``transparent`` keyword).
ARMS: dict[str, tuple[str, bool | None]] = {
    "stock": ("baseline", None),
    "transparent": ("tokencake", True),
    "sdk": ("tokencake", False),
}
#: Generous tokens per seeded word (SmolLM2 measures ~1.13), for sizing the host pool.
TOKENS_PER_WORD = 1.25
#: Tokens of the tool list the template adds to the system turn, and of each turn's chat markup.
TOOLS_BLOCK_TOKENS, MARKUP_TOKENS = 320, 40


def _tool(name: str, description: str, arg: str, values: list[str]) -> dict[str, Any]:
    params = {"type": "object", "properties": {arg: {"type": "string", "enum": values}}, "required": [arg]}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


#: Offered on every request in this order (the system turn, tools included, is one shared prefix);
#: enum arguments keep a forced call short and the same on every system.
TOOLS = [
    _tool(
        "fetch_section", "Read one section of the case file.", "section", ["summary", "methods", "results"]
    ),
    _tool("search_notes", "Search the team's notes on a topic.", "topic", ["cost", "risk", "timeline"]),
    _tool("check_status", "Check the status of a work item.", "item", ["alpha", "beta", "gamma"]),
]
SYSTEM_HEAD = "You are one of several analysts reviewing case files with tools. Shared background:"
TASK = "Work through the case file above with the tools, one call at a time, then answer in one sentence."


@dataclass(frozen=True)
class WorkloadSpec:
    """The workload's knobs; a round's seed turns them into :class:`AgentPlan` s."""

    agents: int = 8
    turns: tuple[int, int] = (3, 5)
    context_words: tuple[int, int] = (300, 1300)
    shared_words: int = 350
    result_words: int = 60
    tool_median_s: float = 3.0
    tool_sigma: float = 0.6
    tool_range_s: tuple[float, float] = (1.0, 8.0)
    start_spread_s: float = 2.0
    tool_max_tokens: int = 64
    answer_max_tokens: int = 24


@dataclass(frozen=True)
class AgentPlan:
    """One agent of one round: when it starts, its document size, its forced tools and their seconds."""

    index: int
    start_s: float
    context_words: int
    tools: tuple[str, ...]
    tool_s: tuple[float, ...]


def plan_agents(spec: WorkloadSpec, seed: int) -> list[AgentPlan]:
    """The agents of a round with workload seed ``seed`` (the same plans for every system)."""
    rng = random.Random(f"transparent-openai:{seed}")
    names = [t["function"]["name"] for t in TOOLS]
    lo, hi = spec.tool_range_s
    plans = []
    for i in range(spec.agents):
        turns = rng.randint(*spec.turns)
        seconds = [rng.lognormvariate(math.log(spec.tool_median_s), spec.tool_sigma) for _ in range(turns)]
        plans.append(
            AgentPlan(
                index=i,
                start_s=round(rng.uniform(0.0, spec.start_spread_s), 3),
                context_words=rng.randint(*spec.context_words),
                tools=tuple(names[(i + t) % len(names)] for t in range(turns)),
                tool_s=tuple(round(min(hi, max(lo, s)), 3) for s in seconds),
            )
        )
    return plans


def shared_system(seed: int, spec: WorkloadSpec) -> str:
    return f"{SYSTEM_HEAD} " + words(random.Random(f"transparent-openai-system:{seed}"), spec.shared_words)


def private_document(seed: int, plan: AgentPlan) -> str:
    """The agent's own case file: a unique header, then ``context_words`` seeded words."""
    return document(MultiTurnSpec(context_tokens=plan.context_words, seed=seed), plan.index)


def tool_result(seed: int, spec: WorkloadSpec, plan: AgentPlan, turn: int) -> str:
    rng = random.Random(f"transparent-openai-result:{seed}:{plan.index}:{turn}")
    return f"{plan.tools[turn]} result {turn}: " + words(rng, spec.result_words)


def host_pool_blocks(spec: WorkloadSpec) -> int:
    """Every agent's largest possible final context at once, in blocks (shared prompt per agent):
    the host pool never has to drop an idle agent's copy."""
    per_turn = spec.result_words * TOKENS_PER_WORD + spec.tool_max_tokens + MARKUP_TOKENS
    final = (
        (spec.shared_words + spec.context_words[1]) * TOKENS_PER_WORD
        + TOOLS_BLOCK_TOKENS
        + spec.turns[1] * per_turn
        + spec.answer_max_tokens
    )
    return spec.agents * math.ceil(final / CPU_BLOCK_TOKENS)


def round_orders(systems: Sequence[str], rounds: int, seed: int) -> list[list[str]]:
    """The system order of each round (:func:`tokencake.bench.rounds.balanced_orders`)."""
    return balanced_orders(systems, rounds, f"transparent-openai:{seed}")


# -- one agent ------------------------------------------------------------------------------------


class AgentError(RuntimeError):
    """An agent could not finish its loop (an HTTP error, or a forced turn without a tool call)."""


def _text_sha1(message: Any) -> str:
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    return hashlib.sha1(json.dumps([message.content or "", calls]).encode()).hexdigest()[:16]


async def _complete(client: Any, calls: list[dict[str, Any]], key: str, **body: Any) -> Any:
    """One chat completion, recorded in ``calls`` (status, latency, usage) whatever its outcome."""
    import openai

    record: dict[str, Any] = {"key": key, "started": time.time(), "status": 200}
    try:
        reply = await client.chat.completions.create(**body)
    except openai.APIStatusError as exc:
        record.update(status=exc.status_code, error=str(exc)[:300])
        raise AgentError(f"{key}: HTTP {exc.status_code}") from exc
    except openai.APIError as exc:
        record.update(status=None, error=f"{type(exc).__name__}: {exc}"[:300])
        raise AgentError(f"{key}: {type(exc).__name__}") from exc
    finally:
        record["latency_s"] = round(time.time() - record["started"], 4)
        calls.append(record)
    usage, choice = reply.usage, reply.choices[0]
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    record.update(
        prompt_tokens=usage.prompt_tokens if usage else None,
        completion_tokens=usage.completion_tokens if usage else None,
        cached_tokens=getattr(details, "cached_tokens", None),
        finish_reason=choice.finish_reason,
        text_sha1=_text_sha1(choice.message),
    )
    return choice.message


async def run_agent(
    client: Any,
    model: str,
    seed: int,
    spec: WorkloadSpec,
    plan: AgentPlan,
    calls: list[dict[str, Any]],
    session: Any = None,
) -> str:
    """The agent's tool loop on the plain client; with a ``tc.Session`` (the SDK arm) each request
    carries its metadata and each tool call runs inside ``tc.stall``. Returns the final answer."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": shared_system(seed, spec)},
        {"role": "user", "content": f"{private_document(seed, plan)}\n\n{TASK}"},
    ]
    common = {"model": model, "tools": TOOLS, "temperature": 0.0}

    def extra(next_tool: str | None = None, **fields: Any) -> dict[str, Any]:
        # The SDK arm announces the tool it forces, as an SDK user would (``next_stall``): the same
        # knowledge transparent mode takes from the forced ``tool_choice``.
        if session is None:
            return fields
        session.next_stall = next_tool
        return {**session.request_metadata(), **fields}

    for turn, tool in enumerate(plan.tools):
        message = await _complete(
            client,
            calls,
            f"agent{plan.index}/agent/{turn}",
            messages=messages,
            tool_choice={"type": "function", "function": {"name": tool}},
            max_tokens=spec.tool_max_tokens,
            extra_body=extra(tool),
            **common,
        )
        if not message.tool_calls:
            raise AgentError(f"agent {plan.index} turn {turn}: forced {tool!r} but got no tool call")
        messages.append(message.model_dump(exclude_none=True))
        if session is not None:
            import tokencake as tc

            stall = tc.stall(session, tool, predicted_s=spec.tool_median_s)
        else:
            stall = contextlib.nullcontext()
        async with stall:
            await anyio.sleep(plan.tool_s[turn])
        content = tool_result(seed, spec, plan, turn)
        messages += [{"role": "tool", "tool_call_id": c.id, "content": content} for c in message.tool_calls]
    answer = await _complete(
        client,
        calls,
        f"agent{plan.index}/agent/{len(plan.tools)}",
        messages=messages,
        tool_choice="none",
        max_tokens=spec.answer_max_tokens,
        extra_body=extra(ignore_eos=True),
        **common,
    )
    return answer.content or ""


# -- one system, one round ------------------------------------------------------------------------


def arm_kwargs(arm: str, config: ServerConfig, server_cls: Any) -> dict[str, Any]:
    """``Server`` keywords of ``arm``: the bench system's, plus ``transparent`` on extension servers.

    A ``Server`` without the keyword has no transparent mode: ``sdk`` then runs without it (the
    same server), ``transparent`` cannot run and raises.
    """
    bench_system, transparent = ARMS[arm]
    kwargs = server_kwargs(SYSTEMS[bench_system], config, server_cls)
    if transparent is None:
        return kwargs
    if "transparent" in inspect.signature(server_cls).parameters:
        kwargs["transparent"] = transparent
    elif transparent:
        raise RuntimeError(
            "tokencake.serving.Server has no `transparent` keyword (no transparent mode in this "
            "checkout): run --systems stock,sdk"
        )
    return kwargs


async def _get_json(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    try:
        response = await client.get(url, timeout=10.0)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def measure(
    arm: str, server: Any, seed: int, spec: WorkloadSpec, plans: list[AgentPlan], round_no: int
) -> dict[str, Any]:
    """Run every agent of the round against a running ``server``; returns the raw measurements."""
    import openai

    root = server.base_url.rstrip("/").removesuffix("/v1")
    stats_url = f"{server.events_url}{STATS_PATH}" if server.events_url else None
    client = openai.AsyncOpenAI(
        base_url=server.base_url, api_key=server.api_key or "EMPTY", timeout=600.0, max_retries=0
    )
    async with httpx.AsyncClient(timeout=30.0) as probe:
        with contextlib.suppress(openai.APIError):  # a warm-up failure shows in the run's calls
            await client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": WARMUP_PROMPT}], max_tokens=4
            )
        metrics_before = parse_metrics((await probe.get(f"{root}/metrics")).text)
        stats_before = await _get_json(probe, stats_url) if stats_url else None
        sessions: dict[int, Any] = {}
        if arm == "sdk":
            import tokencake as tc

            for p in plans:
                sessions[p.index] = tc.Session(
                    f"tbench-{seed}-{round_no}-{p.index}",
                    node="analyst",
                    base_url=server.base_url,
                    events_url=server.events_url,
                    api_key=server.api_key,
                )
        calls: list[dict[str, Any]] = []
        agents: list[dict[str, Any]] = []
        t0 = time.time()

        async def one(plan: AgentPlan) -> None:
            await anyio.sleep(plan.start_s)
            started = time.time()
            record: dict[str, Any] = {"index": plan.index, "start_s": round(started - t0, 3), "status": "ok"}
            try:
                await run_agent(client, server.model, seed, spec, plan, calls, sessions.get(plan.index))
            except Exception as exc:
                record.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:500])
            record["agent_s"] = round(time.time() - started, 4)
            agents.append(record)

        async with anyio.create_task_group() as tg:
            for plan in plans:
                tg.start_soon(one, plan)
        makespan = time.time() - t0
        metrics_after = parse_metrics((await probe.get(f"{root}/metrics")).text)
        stats_after = await _get_json(probe, stats_url) if stats_url else None
    reporter = next((s.reporter for s in sessions.values() if s.reporter is not None), None)
    delivery = reporter.stats() if reporter is not None else None
    if reporter is not None:
        await reporter.aclose()
    await client.close()
    agents.sort(key=lambda a: a["index"])
    calls.sort(key=lambda c: c["started"])
    return summarize_run(
        makespan, agents, calls, metrics_before, metrics_after, stats_before, stats_after
    ) | {"stall_delivery": delivery}


def run_system(
    arm: str, config: ServerConfig, seed: int, spec: WorkloadSpec, round_no: int, server_cls: Any
) -> dict[str, Any]:
    """Start a fresh server for ``arm``, run the round's agents on it, stop it."""
    plans = plan_agents(spec, seed)
    kwargs = arm_kwargs(arm, config, server_cls)
    t_boot, load = time.time(), loadavg()
    with server_cls(**kwargs) as server:
        boot_s = time.time() - t_boot
        data = anyio.run(measure, arm, server, seed, spec, plans, round_no)
        args = list(server.vllm_args())
        log_path = str(server.log_path) if server.log_path else None
    dtype = args[args.index("--dtype") + 1] if "--dtype" in args else "model default"
    return {
        "system": arm,
        "transparent": kwargs.get("transparent"),
        "server_start_s": round(boot_s, 3),
        "loadavg_start": load,
        "dtype": dtype,
        "vllm_args": args,
        "log_file": log_path,
        **data,
    }


def main(argv: Sequence[str] | None = None, server_cls: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 agents, 2 tool turns, 1 round, 32 device blocks")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 3; --quick 1)")
    p.add_argument("--agents", type=int, help="concurrent agents (default 8; --quick 2)")
    p.add_argument("--turns", type=int, nargs=2, metavar=("LO", "HI"), help="tool turns per agent (3 5)")
    p.add_argument("--tool-median-s", type=float, default=WorkloadSpec.tool_median_s)
    p.add_argument("--device-blocks", type=int, help="device KV blocks (default 40; --quick 32)")
    p.add_argument("--host-pool-blocks", type=int, help="default: every agent's largest context")
    p.add_argument("--systems", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    p.add_argument("--seed", type=int, help="base seed (default: a fresh random one, recorded)")
    p.add_argument("--model", help="model (default: the bundled one)")
    p.add_argument("--out", help="output prefix (default docs/bench/transparent-openai[-quick])")
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(ARMS))
    if unknown or not systems:
        p.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    quick = args.quick
    spec = WorkloadSpec(
        agents=args.agents or (2 if quick else WorkloadSpec.agents),
        turns=tuple(args.turns) if args.turns else ((2, 2) if quick else WorkloadSpec.turns),
        tool_median_s=args.tool_median_s,
    )
    rounds = args.rounds or (1 if quick else 3)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    blocks = args.device_blocks or (32 if quick else 40)
    config = ServerConfig(
        model=args.model,
        device_blocks=blocks,
        # vLLM refuses to start unless one request of the model length fits the device KV (less
        # the one block it keeps back).
        max_model_len=min(4096, (blocks - 1) * CPU_BLOCK_TOKENS),
        host_pool_blocks=args.host_pool_blocks or host_pool_blocks(spec),
    )
    if server_cls is None:
        from tokencake.serving import Server as server_cls
    for arm in systems:
        arm_kwargs(arm, config, server_cls)  # fail before any server starts
    out = Path(args.out or ("docs/bench/transparent-openai" + ("-quick" if quick else "")))
    started, t_start, ver, load = utc_now(), time.time(), versions(), loadavg()
    orders = round_orders(systems, rounds, seed)
    round_seeds = [hash_seed(f"transparent-openai:{seed}:{r}") for r in range(rounds)]
    results_rounds: list[dict[str, Any]] = []
    warnings: list[str] = []
    failed = False
    for r, (order, round_seed) in enumerate(zip(orders, round_seeds, strict=True), start=1):
        runs: dict[str, Any] = {}
        for position, arm in enumerate(order):
            print(f"round {r}/{rounds}: {arm} ({position + 1}/{len(order)})", file=sys.stderr, flush=True)
            try:
                runs[arm] = run_system(arm, config, round_seed, spec, r, server_cls) | {"position": position}
            except Exception as exc:  # one broken system must not discard the others' runs
                warnings.append(f"round {r}: {arm} did not complete: {type(exc).__name__}: {str(exc)[:400]}")
                failed = True
                continue
            a = runs[arm]["agent_s"]
            print(f"  mean agent {a['mean']} s, makespan {runs[arm]['makespan_s']} s", file=sys.stderr)
        runs = {s: runs[s] for s in systems if s in runs}
        check = equal_work({s: run["calls"] for s, run in runs.items()}).to_dict()
        if not check["passed"] and len(runs) > 1:
            warnings.append(f"round {r}: equal-work check failed: the systems did not do the same work")
            failed = True
        for s, run in runs.items():
            if run["http_errors"] or run["agents_failed"]:
                warnings.append(
                    f"round {r}: {s}: {run['http_errors']} HTTP errors, {run['agents_failed']} failed"
                )
                failed = True
        computed = {s: run["prefix_tokens"]["computed"] for s, run in runs.items()}
        if "stock" in computed and len(computed) > 1:
            others = min(v for s, v in computed.items() if s != "stock")
            if computed["stock"] <= 1.02 * others:
                warnings.append(
                    f"round {r}: stock vLLM computed (almost) no more prompt tokens than the extension: "
                    "no KV pressure to win back (shrink --device-blocks or add --agents)"
                )
        plans = [asdict(pl) for pl in plan_agents(spec, round_seed)]
        results_rounds.append(
            {
                "round": r,
                "seed": round_seed,
                "order": order,
                "plans": plans,
                "equal_work": check,
                "systems": runs,
            }
        )
    results = {
        "kind": "transparent-openai",
        "started": started,
        "finished": utc_now(),
        "wall_s": round(time.time() - t_start, 3),
        "config": {
            "quick": quick,
            "systems": systems,
            "seed": seed,
            "round_seeds": round_seeds,
            "rounds": rounds,
            "workload": asdict(spec),
            "tools": TOOLS,
            **asdict(config),
        },
        "versions": ver,
        "machine": {**machine(), "loadavg_start": load, "loadavg_end": loadavg()},
        "warnings": warnings,
        "rounds": results_rounds,
        "aggregate": aggregate(results_rounds, systems),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}-results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    summary = markdown(results)
    Path(f"{out}-summary.md").write_text(summary)
    print(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
