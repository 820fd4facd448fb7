"""Soak: many concurrent SDK app runs against one server; afterwards nothing may be left behind.

N (default 100) runs of a small synthetic agent app start at once (``asyncio.gather``) through one
``tc.LLM``: a researcher agent (three LLM turns of one conversation with a search and a fetch tool
call between them, seeded random tool times) followed by a writer agent. Every tool call is a
``stall_begin`` / ``stall_end`` pair on the extension. Checked:

* every run finishes with status ``ok`` within ``--run-timeout`` and all stall events were
  delivered (reporter failures 0);
* after ``--grace`` seconds, ``/v1/stats`` shows no active stall (engine and tracker), no host
  pool slot pinned (``host_pool.owners``) or filling, and no copy job in flight.

    # start its own server (small device cache so that stalls offload), full size
    .venv/bin/python benchmarks/soak.py
    # a quick check: 10 runs
    .venv/bin/python benchmarks/soak.py --small
    # against a running `tokencake serve`
    .venv/bin/python benchmarks/soak.py --base-url http://127.0.0.1:8000/v1 \\
        --events-url http://127.0.0.1:8001 [--api-key KEY] [-n 100]

Prints a summary and one JSON line; exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

import tokencake as tc

WORDS = (
    "amber basil cedar dune ember fjord grove heath inlet juniper kelp larch moss nectar orchid pine "
    "quartz reed sage thistle umber vale willow yarrow zinnia river stone market garden engine signal"
).split()


def _words(seed: str, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_app(index: int, tool_s: tuple[float, float], context_words: int, max_tokens: int) -> tc.App:
    """One run's app: researcher (LLM, search, LLM, fetch, LLM) then writer (LLM)."""
    app = tc.App(f"soak-{index}", description="soak: synthetic multi-turn agent with two tools")
    rng = random.Random(f"soak-{index}")
    times = [rng.uniform(*tool_s) for _ in range(2)]
    predicted = sum(tool_s) / 2

    @app.tool(predict_time=predicted, kind="search")
    async def search(query: str) -> str:
        """Search the notes (a seeded sleep).

        Args:
            query: what to look for.
        """
        await asyncio.sleep(times[0])
        return f"hits for {query}: " + _words(f"{index}-search", 12)

    @app.tool(predict_time=predicted, kind="file")
    async def fetch(name: str) -> str:
        """Fetch a document (a seeded sleep).

        Args:
            name: which document.
        """
        await asyncio.sleep(times[1])
        return f"{name}: " + _words(f"{index}-fetch", 12)

    @app.agent(
        system=f"You are researcher {index}. Notes: " + _words(f"{index}-notes", context_words),
        max_tokens=max_tokens,
        temperature=0.0,
        calls=["search", "fetch"],
    )
    async def researcher(ctx: tc.Context, inputs: dict[str, object]) -> str:
        reply = await ctx.llm("Pick one word from the notes.")
        hits = await ctx.call("search", query=reply.text[:40] or "notes")
        reply = await ctx.llm(f"Search said: {hits}. Pick a document name.")
        doc = await ctx.call("fetch", name=reply.text[:40] or "doc")
        return (await ctx.llm(f"The document says: {doc}. Summarize in five words.")).text

    @app.agent(after=["researcher"], max_tokens=max_tokens, temperature=0.0)
    async def writer(ctx: tc.Context, inputs: dict[str, object]) -> str:
        return (await ctx.llm(f"Rewrite as a title: {inputs['researcher']}")).text

    return app


async def run_all(llm: tc.LLM, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start every run at once; collect status and timing per run (never raises)."""

    async def one(i: int) -> dict[str, Any]:
        app = build_app(i, (args.tool_min, args.tool_max), args.context_words, args.max_tokens)
        t0 = time.monotonic()
        try:
            result = await app.run(llm=llm, timeout=args.run_timeout)
            return {"run": i, "status": result.status, "seconds": time.monotonic() - t0}
        except Exception as exc:
            return {"run": i, "status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}

    return list(await asyncio.gather(*(one(i) for i in range(args.n))))


def leftovers(stats: dict[str, Any]) -> dict[str, Any]:
    """What is still held: must all be 0 once every run finished (None: not reported)."""
    engine, pool, sessions = stats.get("engine", {}), stats.get("host_pool", {}), stats.get("sessions", {})
    return {
        "engine.active_stalls": engine.get("active_stalls"),
        "engine.jobs_in_flight": engine.get("jobs_in_flight"),
        "sessions.active_stalls": sessions.get("active_stalls"),
        "host_pool.owners": pool.get("owners"),
        "host_pool.filling": pool.get("filling"),
    }


def get_stats(events_url: str, api_key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(events_url + "/v1/stats", headers=headers, timeout=10.0)
        resp.raise_for_status()
        return dict(resp.json())
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": str(exc)}


@contextlib.contextmanager
def own_server(args: argparse.Namespace) -> Iterator[Any]:
    from tokencake.serving import Server

    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    srv = Server(
        num_gpu_blocks=args.device_blocks,
        max_model_len=4096,
        log_file=Path(args.log_dir) / "soak-tokencake.log",
        progress=True,
    )
    with srv:
        yield srv


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="running TokenCake server (OpenAI base URL, .../v1)")
    p.add_argument("--events-url", help="its events URL (default: base port + 1)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("-n", type=int, default=100, help="concurrent app runs")
    p.add_argument("--small", action="store_true", help="a quick check: 10 runs")
    p.add_argument("--tool-min", type=float, default=0.5)
    p.add_argument("--tool-max", type=float, default=6.0)
    p.add_argument("--context-words", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--run-timeout", type=float, default=1800.0)
    p.add_argument("--grace", type=float, default=30.0, help="seconds to wait for the server to settle")
    p.add_argument("--device-blocks", type=int, default=64, help="device KV blocks of the server it starts")
    p.add_argument("--log-dir", default="bench-out/soak")
    p.add_argument("--json", default=None, help="also write the JSON summary here")
    args = p.parse_args(argv)
    if args.small:
        args.n, args.tool_max = 10, 3.0

    with contextlib.ExitStack() as stack:
        if args.base_url:
            base_url, api_key = args.base_url, args.api_key
            events_url = args.events_url or _events_url(base_url)
            model = args.model
        else:
            srv = stack.enter_context(own_server(args))
            base_url, events_url, model, api_key = srv.base_url, srv.events_url, srv.model, None
        before = get_stats(events_url, api_key)
        llm = tc.LLM(base_url, model, api_key, events_url=events_url, timeout=args.run_timeout)
        t0 = time.monotonic()
        runs = asyncio.run(run_all(llm, args))
        wall = time.monotonic() - t0
        reporter = llm.stall_reporter()
        deadline = time.monotonic() + args.grace
        while True:  # copies and pins settle after the last reply
            stats = get_stats(events_url, api_key)
            left = leftovers(stats)
            if all(v == 0 for v in left.values()) or time.monotonic() > deadline:
                break
            time.sleep(1.0)

    failed = [r for r in runs if r["status"] != "ok"]
    counters, counters_before = stats.get("counters", {}), before.get("counters", {})
    delta = {
        k: v - counters_before.get(k, 0)
        for k, v in counters.items()
        if isinstance(v, (int, float)) and v != counters_before.get(k, 0)
    }
    checks = {
        "all_runs_ok": not failed,
        "events_delivered": reporter is not None and reporter.failures == 0,
        "nothing_left": all(v == 0 for v in left.values()),
        "no_hook_errors": not any(k.startswith("errors.") for k in delta),
    }
    seconds = sorted(r["seconds"] for r in runs if "seconds" in r)
    summary = {
        "runs": args.n,
        "ok_runs": args.n - len(failed),
        "wall_s": round(wall, 1),
        "run_s_p50": seconds[len(seconds) // 2] if seconds else None,
        "run_s_max": seconds[-1] if seconds else None,
        "failed_examples": failed[:5],
        "reporter_failures": getattr(reporter, "failures", None),
        "leftovers": left,
        "stalls": {k: v for k, v in delta.items() if k.startswith(("events.", "acks."))},
        "copies": {
            k: v
            for k, v in delta.items()
            if k.split(".")[0] in ("offload", "prefetch", "load", "demand_load", "jobs", "errors")
        },
        "checks": checks,
    }
    print(f"{summary['ok_runs']}/{args.n} runs ok in {summary['wall_s']} s; leftovers {left}")
    print(f"copies {summary['copies']}")
    for name, passed in checks.items():
        print(f"  {'ok  ' if passed else 'FAIL'} {name}")
    line = json.dumps(summary, default=str)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0 if all(checks.values()) else 1


def _events_url(base_url: str) -> str:
    url = httpx.URL(base_url)
    return f"{url.scheme}://{url.host}:{(url.port or 80) + 1}"


if __name__ == "__main__":
    sys.exit(main())
