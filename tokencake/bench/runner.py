"""A whole benchmark: every workload point against every system, round after round.

For each workload point and each system, one after another (in a balanced order across rounds,
:func:`system_order`): start a fresh server, replay the point on it (:mod:`tokencake.bench.replay`),
stop the server. The systems of a point are then compared (:mod:`tokencake.bench.compare`) and the
rounds pooled (:mod:`tokencake.bench.rounds`). The collected raw data goes into one results dict that
:mod:`tokencake.bench.report` turns into files (and :mod:`tokencake.bench.terminal` into a table);
nothing here formats output.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from tokencake.bench import apps as _apps
from tokencake.bench.compare import compare
from tokencake.bench.environment import loadavg, machine, utc_now, versions
from tokencake.bench.equal_work_check import equal_work
from tokencake.bench.replay import replay, root_url
from tokencake.bench.revisions import SourceTree, prepare_source
from tokencake.bench.rounds import aggregate, balanced_orders
from tokencake.bench.systems import ServerConfig, SystemSpec, server_kwargs
from tokencake.bench.workload import Workload
from tokencake.events import STATS_PATH

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
    #: One discarded chat completion per system before its replay (see :func:`tokencake.bench.replay.replay`).
    warmup: bool = True
    #: Run the systems of each round in a seeded, position-balanced order (:func:`system_order`), so
    #: that drift of the machine over a long run (thermal, page cache, other load) does not favour one
    #: system; False keeps the configured order.
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


def system_order(config: BenchConfig, rep: int, point: str) -> list[SystemSpec]:
    """The order the systems run in for round ``rep`` (0-based) of ``point``: balanced across rounds.

    Rows of seeded Latin squares (:func:`~tokencake.bench.rounds.balanced_orders`): in every block of
    as many rounds as systems, each system runs once in each position. Seeded by
    ``config.order_seed`` and the point label, so a rerun with the same seed runs the same orders.
    """
    if not config.shuffle_systems:
        return list(config.systems)
    by_name = {s.name: s for s in config.systems}
    rows = balanced_orders(list(by_name), rep + 1, f"{config.order_seed}:{point}")
    return [by_name[n] for n in rows[rep]]


def run_bench(
    config: BenchConfig,
    *,
    log_dir: Path | None = None,
    progress: Progress | None = None,
    server_cls: Any = None,
    build_app: Callable[..., Any] = _apps.build,
    transport: Callable[[], httpx.AsyncBaseTransport] | None = None,
    replicas_cls: Any = None,
    src_dir: Path | None = None,
    rounds: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Run every point against every system, sequentially; returns the results dict.

    ``server_cls`` starts one server (default :class:`tokencake.serving.Server`), ``replicas_cls``
    a system's replicas behind a router (default :class:`tokencake.serving.replicas.Replicas`).
    ``src_dir`` holds the exported trees of ``NAME@REV`` systems (:func:`sources_for`).
    ``rounds``: the 0-based rounds to run, of ``config.repeat`` (default all): each runs in its own
    balanced order (:func:`system_order`) and is labelled as in the whole run, so runs of disjoint
    rounds pool into the run of all of them (a resumable run set runs one round at a time).
    """
    if server_cls is None:
        from tokencake.serving import Server as server_cls
    progress = progress or Progress()
    started_at, t_start = utc_now(), time.time()
    # The code that runs is the code at the start (a commit made meanwhile must not be recorded).
    versions_at_start, load_at_start = versions(), loadavg()
    points_out: list[dict[str, Any]] = []
    warnings: list[str] = []
    failed_systems: list[str] = []
    if config.repeat < 1:
        raise ValueError("repeat must be >= 1")
    reps = list(range(config.repeat)) if rounds is None else list(dict.fromkeys(rounds))
    if not reps or any(not 0 <= rep < config.repeat for rep in reps):
        raise ValueError(f"rounds must be among 0..{config.repeat - 1}, got {list(rounds or [])}")
    sources = sources_for(config, src_dir)
    orders: list[dict[str, Any]] = []
    for rep, point in [(rep, point) for rep in reps for point in config.points]:
        label = point.label if config.repeat == 1 else f"{point.label}#{rep + 1}"
        per_system: dict[str, Any] = {}
        run_order = system_order(config, rep, point.label)
        orders.append({"round": rep + 1, "point": point.label, "order": [s.name for s in run_order]})
        for spec in run_order:
            kwargs = server_kwargs(spec, config.server, server_cls, sources.get(spec.source_commit or ""))
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                # Labels of swept points ("hetero@0.25/s") and revisions may hold "/": one flat directory.
                kwargs["log_file"] = str(log_dir / f"{label}-{spec.name}.log".replace("/", "_"))
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
            data["served"] = served_provenance(server)
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
        "finished": utc_now(),
        "wall_s": round(time.time() - t_start, 3),
        "valid": valid,
        "warnings": warnings,
        "failed_systems": failed_systems,
        "config": config.to_dict(),
        "versions": versions_at_start,
        "machine": {**machine(), "loadavg_start": load_at_start, "loadavg_end": loadavg()},
        "system_orders": orders,
        # 1-based, as the points' ``repeat``: every round of ``config.repeat`` unless ``rounds`` chose some.
        "rounds_run": [rep + 1 for rep in reps],
        **({"sources": _sources_record(config, sources)} if sources else {}),
        "points": points_out,
        "aggregate": aggregate(points_out) if len(reps) > 1 else None,
    }


def sources_for(config: BenchConfig, src_dir: Path | None) -> dict[str, SourceTree]:
    """The exported tree of every commit a ``NAME@REV`` system's server imports, by commit.

    Under ``src_dir``, or a shared directory in the temp dir: an export is named by its full commit
    and never changes once complete, so runs can share it.
    """
    commits = dict.fromkeys(s.source_commit for s in config.systems if s.source_commit)
    if not commits:
        return {}
    dest = src_dir if src_dir is not None else Path(tempfile.gettempdir()) / "tokencake-bench-src"
    return {c: prepare_source(c, dest, config.server) for c in commits}


def _sources_record(config: BenchConfig, sources: Mapping[str, SourceTree]) -> dict[str, Any]:
    """Per ``NAME@REV`` system: the commit its server ran and how its start differed."""
    return {
        s.name: sources[s.source_commit].to_dict()
        for s in config.systems
        if s.source_commit and s.source_commit in sources
    }


#: vLLM flags a results file records as the system's provenance: what the server was actually given.
PROVENANCE_FLAGS = {
    "dtype": ("--dtype", "auto"),
    "scheduling_policy": ("--scheduling-policy", "fcfs"),
    "scheduler_cls": ("--scheduler-cls", None),
    "num_gpu_blocks": ("--num-gpu-blocks-override", None),
    "max_model_len": ("--max-model-len", None),
}


def served_provenance(server: Any) -> dict[str, Any]:
    """What one system's vLLM was started with (dtype, scheduling policy, scheduler class, device
    blocks, and the connector's host-pool blocks), read from the argv the server built (its first
    replica's); vLLM's default where a flag is absent, ``host_pool_blocks`` None without the
    connector or a pool size in blocks. Empty when the server cannot say (a stand-in without
    ``vllm_args``)."""
    target = (getattr(server, "servers", None) or [server])[0]
    build = getattr(target, "vllm_args", None)
    if build is None:
        return {}
    try:
        args = list(build())
    except Exception:  # provenance must never fail a measured run
        return {}
    out: dict[str, Any] = {}
    for key, (flag, default) in PROVENANCE_FLAGS.items():
        out[key] = _flag(args, flag, default)
    out["host_pool_blocks"] = _host_pool_blocks(_flag(args, "--kv-transfer-config", None))
    return out


def _flag(args: list[str], flag: str, default: str | None) -> str | None:
    """The value of ``flag`` in ``args`` (argparse keeps the last one), else ``default``."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return values[-1] if values else default


def _host_pool_blocks(transfer_config: str | None) -> int | None:
    """``host_pool_blocks`` of a ``--kv-transfer-config`` JSON's connector config, if any."""
    try:
        extra = json.loads(transfer_config or "{}").get("kv_connector_extra_config") or {}
        return int(extra["host_pool_blocks"]) if "host_pool_blocks" in extra else None
    except (ValueError, TypeError, AttributeError):
        return None


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
            (root_url(s.base_url), f"{s.events_url.rstrip('/')}{STATS_PATH}" if s.events_url else None)
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
