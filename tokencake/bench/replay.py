"""One replay: every arrival of a workload against one running server, and the raw measurements.

Snapshot the server's ``/metrics`` and extension stats, replay the arrivals through the SDK (sampling
KV usage in the background), snapshot again; the deltas and client-side records are the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import httpx

from tokencake.agents._http import pool_limits
from tokencake.bench import apps as _apps
from tokencake.bench.calls import CallRecorder
from tokencake.bench.extension_stats import extension_summary, merge_stats, stats_delta
from tokencake.bench.kv_sampler import KVSampler
from tokencake.bench.metrics import client_summary
from tokencake.bench.server_metrics import merge_metrics, server_summary
from tokencake.bench.workload import Workload
from tokencake.events import STATS_PATH
from tokencake.serving.prometheus import Metrics, parse_metrics


def root_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def _node_timings(result: Any) -> dict[str, dict[str, Any]]:
    nodes = getattr(result, "nodes", None) or {}
    out: dict[str, dict[str, Any]] = {}
    for name, node in nodes.items():
        usage = getattr(node, "usage", None)
        out[name] = {
            "status": getattr(node, "status", None),
            "started": getattr(node, "started", None),
            "finished": getattr(node, "finished", None),
            "queue_s": getattr(node, "queue_s", None),
            "llm_s": getattr(node, "llm_s", None),
            "tool_s": getattr(node, "tool_s", None),
            "stall_s": getattr(node, "stall_s", None),
            "llm_calls": getattr(node, "llm_calls", None),
            "tool_calls": getattr(node, "tool_calls", None),
            "completion_tokens": getattr(usage, "completion_tokens", None),
        }
    return out


WARMUP_PROMPT = "Warm-up request, not part of the benchmark. Reply with one word."


async def _warmup(client: httpx.AsyncClient, base_url: str, model: str | None) -> float | None:
    """One discarded chat completion; seconds it took, None when it failed (never fatal)."""
    t = time.time()
    try:
        if model is None:
            listed = (await client.get(f"{base_url.rstrip('/')}/models")).json()
            model = listed["data"][0]["id"]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": WARMUP_PROMPT}],
            "max_tokens": 4,
            "temperature": 0,
        }
        response = await client.post(f"{base_url.rstrip('/')}/chat/completions", json=body, timeout=120.0)
        response.raise_for_status()
    except Exception:
        return None
    return round(time.time() - t, 3)


async def _get_json(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    try:
        response = await client.get(url, timeout=10.0)
        if response.status_code == 200:
            data = response.json()
            return data if isinstance(data, dict) else None
    except (httpx.HTTPError, ValueError):
        pass
    return None


async def replay(
    workload: Workload,
    *,
    base_url: str,
    model: str | None,
    events_url: str | None,
    stock: bool,
    kv_interval_s: float = 0.5,
    app_timeout_s: float | None = 600.0,
    llm_timeout_s: float = 600.0,
    on_app_done: Callable[[bool], None] | None = None,
    build_app: Callable[..., Any] = _apps.build,
    llm_factory: Callable[..., Any] | None = None,
    transport: Callable[[], httpx.AsyncBaseTransport] | None = None,
    warmup: bool = True,
    backends: Sequence[tuple[str, str | None]] | None = None,
) -> dict[str, Any]:
    """Run every arrival of ``workload`` against one running server; returns the raw measurements.

    ``transport`` makes the HTTP transports (tests pass an ``httpx.MockTransport`` factory).
    ``backends``: for replicas behind a router at ``base_url``, each replica's (root URL, stats URL
    or None); their metrics and stats are read and merged instead of ``base_url``'s and
    ``events_url``'s (pass ``events_url=False``: no events listener is reachable through a router).
    ``warmup`` sends one short, unrelated chat completion first and discards it (a fresh server's
    first request pays one-time costs; its prompt shares no prefix with the workload's).
    """
    import tokencake as tc

    def make_transport() -> httpx.AsyncBaseTransport:
        if transport is not None:
            return transport()
        return httpx.AsyncHTTPTransport(
            limits=pool_limits(max_connections=None, max_keepalive_connections=64)
        )

    if backends:
        roots = [root for root, _stats in backends]
        stats_urls = [] if stock else [u for _root, u in backends if u]
    else:
        roots = [root_url(base_url)]
        stats_urls = [f"{events_url.rstrip('/')}{STATS_PATH}"] if (events_url and not stock) else []
    async with httpx.AsyncClient(timeout=30.0, transport=make_transport()) as probe:

        async def fetch_metrics() -> Metrics:
            parts = []
            for root in roots:
                response = await probe.get(f"{root}/metrics")
                response.raise_for_status()
                parts.append(parse_metrics(response.text))
            return merge_metrics(parts)

        async def fetch_stats() -> dict[str, Any] | None:
            if not stats_urls:
                return None
            return merge_stats([await _get_json(probe, u) for u in stats_urls])

        warmup_s = await _warmup(probe, base_url, model) if warmup else None
        metrics_before = await fetch_metrics()
        stats_before = await fetch_stats()

        recorder = CallRecorder(make_transport(), overrides=workload.llm.overrides())
        http_client = httpx.AsyncClient(
            transport=recorder, timeout=httpx.Timeout(llm_timeout_s, connect=30.0)
        )
        factory = llm_factory or tc.LLM
        llm = factory(
            base_url=base_url,
            model=model,
            events_url=(events_url if not stock else False),
            http_client=http_client,
            timeout=llm_timeout_s,
            max_retries=0,
        )
        sampler = KVSampler(fetch_metrics, interval_s=kv_interval_s)
        apps: list[dict[str, Any]] = []
        t0 = time.time()

        async def run_one(arrival: Any, started: float) -> None:
            record: dict[str, Any] = {
                "index": arrival.index,
                "app": arrival.app,
                "run_id": arrival.run_id,
                "arrival_s": round(started - t0, 6),
            }
            try:
                app = build_app(arrival, workload.latency)
                result = await app.run(
                    llm=llm, run_id=arrival.run_id, timeout=app_timeout_s, **dict(arrival.inputs)
                )
            except Exception as exc:
                record.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:1000])
                cause = exc.__cause__
                if cause is not None:
                    record["cause"] = f"{type(cause).__name__}: {cause}"[:1000]
                result = None
            else:
                record["status"] = "ok"
            finished = time.time()
            record["e2e_s"] = round(finished - started, 6)
            if result is not None:
                record["wall_s"] = getattr(result, "wall_s", None)
                record["nodes"] = _node_timings(result)
                record["stall_events"] = len(getattr(result, "stall_events", None) or ())
            apps.append(record)
            if on_app_done is not None:
                on_app_done(record["status"] == "ok")

        async with anyio.create_task_group() as outer:
            outer.start_soon(sampler.run)
            async with anyio.create_task_group() as tg:
                if workload.arrival == "concurrent":
                    limiter = anyio.CapacityLimiter(workload.concurrency or workload.num_apps)

                    async def closed_loop(arrival: Any) -> None:
                        async with limiter:
                            await run_one(arrival, time.time())

                    for arrival in workload.arrivals:
                        tg.start_soon(closed_loop, arrival)
                else:
                    for arrival in workload.arrivals:
                        delay = t0 + arrival.at_s - time.time()
                        if delay > 0:
                            await anyio.sleep(delay)
                        tg.start_soon(run_one, arrival, t0 + arrival.at_s)
            replay_s = time.time() - t0
            await sampler.sample_once()
            outer.cancel_scope.cancel()

        metrics_after = await fetch_metrics()
        stats_after = await fetch_stats()
        aclose = getattr(llm, "aclose", None)
        if aclose is not None:
            await aclose()  # the SDK's stall reporter; our http_client is closed below
        await http_client.aclose()

    calls = [r.to_dict() for r in sorted(recorder.records, key=lambda r: (r.started, r.key))]
    apps.sort(key=lambda a: a["index"])
    return {
        "replay_s": round(replay_s, 3),
        "warmup_s": warmup_s,
        "apps": apps,
        "calls": calls,
        "client": client_summary(apps, calls),
        "server": server_summary(metrics_before, metrics_after),
        "extension": (
            {
                "summary": extension_summary(stats_after, stats_before),
                "delta": stats_delta(stats_before, stats_after),
                "after": stats_after,
            }
            if stats_urls
            else None
        ),
        "kv": sampler.summary(t0),
    }
