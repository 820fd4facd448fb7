"""Named benchmark configurations: ``ci``, ``headroom``, ``stress``, ``paper`` and ``catalog``.

* ``ci`` — a few minutes on 2 CPU cores including three server starts. Six synthetic multi-turn agents
  (~1,000-token private contexts, 3 turns, 3.5–4.5 s tools, 24 output tokens per turn) on a 40-block
  device KV cache: enough pressure that stock vLLM evicts an idle agent's prefix during its tool call.
* ``headroom`` — the research digest's headroom experiment: six agents, ~1,000-token contexts, 6 turns,
  3 s tools, 40 device blocks vs a never-evicting ideal. The larger run (about 3 minutes on 2 cores).
* ``stress`` — deliberately unlike ``ci``/``headroom`` (which the KV policy was calibrated on): the
  fan-in ``agent_mix`` app (:mod:`tokencake.bench.agent_mix`) with heterogeneous contexts and turn
  counts, heavy-tailed tool times, a tool whose hint is wrong by 2x, staggered worker starts and
  Poisson app arrivals. Two points: ``hetero`` (private contexts only) and ``shared`` (every worker's
  prompt opens with the same long preamble). Sized for at most ~2.5 minutes per system and point on
  2 cores (41 LLM calls of ~1-2k-token prompts per point; an estimate, see docs/benchmarks.md).
* ``paper`` — the paper's setting: Code-Writer + Deep-Research from the catalog with published tool
  times, Poisson arrivals swept over 0.05 … 1.0 apps/s. Each point replays ``apps`` arrivals on every
  system; on 2 CPU cores with SmolLM2-135M a 10-app point takes roughly 5–10 minutes per system, the
  sweep about two hours (measured basis in docs/benchmarks.md). ``--rates`` / ``--apps`` cut it down.
* ``catalog`` — the bundled apps as the product's users run them: Deep-Research + Code-Writer with
  ``context=realistic`` (researchers read whole documents, programmers keep files and test logs:
  ~2.5-2.8k tokens per agent), arriving together, published tool times, 40 device blocks. One app's
  parallel stage alone (~8k tokens) is 1.6x the device cache (:func:`catalog_pressure`). Estimated at
  5-7 minutes per system on 2 cores (docs/benchmarks.md); not yet measured.

Every knob can be overridden from the command line (:class:`Overrides`); the resulting config, including
the full workload, is stored in ``results.json``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokencake.bench import agent_mix
from tokencake.bench.runner import BenchConfig, Point
from tokencake.bench.synthetic import DESCRIPTION as SYNTHETIC_DESCRIPTION
from tokencake.bench.synthetic import MultiTurnSpec
from tokencake.bench.systems import ServerConfig, resolve_systems
from tokencake.bench.workload import (
    AGENT_MIX_APP,
    SYNTHETIC_APP,
    SYNTHETIC_APPS,
    LLMSettings,
    Workload,
    make_workload,
)

CPU_BLOCK_TOKENS = 128


@dataclass
class Overrides:
    """Command-line overrides; None = the preset's value."""

    seed: int = 0
    model: str | None = None
    systems: list[str] | None = None
    apps: int | None = None
    concurrency: int | None = None
    rates: list[float] | None = None
    arrival: str | None = None
    latency: str | None = None
    turns: int | None = None
    context_tokens: int | None = None
    max_tokens: int | None = None
    tool_s: tuple[float, float] | None = None
    device_blocks: int | None = None
    ideal_blocks: int | None = None
    host_pool_blocks: int | None = None
    kv_interval_s: float | None = None
    #: Interleaved rounds; None = the preset's default (:data:`HEADLINE_REPEAT` for headline presets).
    repeat: int | None = None
    #: Keep the configured system order in every round (default: rows of seeded Latin squares).
    fixed_order: bool = False
    warmup: bool = True
    #: Worker agents per app (``stress``).
    workers: int | None = None
    #: Subset of the preset's point labels (``stress``: ``hetero``, ``shared``); None = all.
    points: list[str] | None = None
    #: App name -> weight; replaces the preset's app mix (catalog names or a synthetic app).
    mix: dict[str, float] | None = None
    extra_server_args: list[str] = field(default_factory=list)


#: Rounds by default for the presets whose numbers are quoted as headlines (issue 10: ≥ 5 rounds, so
#: the intervals are not dominated by the t factor of 2 degrees of freedom).
HEADLINE_REPEAT = {"headroom": 5, "stress": 5}


def _pick(value, default):
    return default if value is None else value


def _config(
    preset: str,
    o: Overrides,
    *,
    points: list[Point],
    server: ServerConfig,
    kv_interval_s: float,
    app_timeout_s: float,
    description: str,
) -> BenchConfig:
    """What every preset shares: systems, interleaved shuffled repeats, overridable sampling interval."""
    return BenchConfig(
        preset=preset,
        points=points,
        systems=resolve_systems(o.systems),
        server=server,
        kv_interval_s=_pick(o.kv_interval_s, kv_interval_s),
        app_timeout_s=app_timeout_s,
        repeat=_pick(o.repeat, HEADLINE_REPEAT.get(preset, 1)),
        shuffle_systems=not o.fixed_order,
        warmup=o.warmup,
        order_seed=o.seed,
        description=description,
    )


def _blocks_for_contexts(sessions: int, spec: MultiTurnSpec) -> int:
    """Device blocks that hold every session's final context at once, with room for one more."""
    per_turn = spec.max_tokens + spec.tool_result_tokens + 40  # reply + tool result + question/template
    final_tokens = spec.context_tokens * 1.25 + 64 + spec.turns * per_turn
    return (sessions + 1) * math.ceil(final_tokens / CPU_BLOCK_TOKENS) + 8


def _multi_turn(
    name: str,
    o: Overrides,
    *,
    agents: int,
    turns: int,
    context_tokens: int,
    max_tokens: int,
    tool_s: tuple[float, float],
    device_blocks: int,
    purpose: str,
) -> BenchConfig:
    spec = MultiTurnSpec(
        agents=1,
        turns=_pick(o.turns, turns),
        context_tokens=_pick(o.context_tokens, context_tokens),
        max_tokens=_pick(o.max_tokens, max_tokens),
        tool_s=_pick(o.tool_s, tool_s),
    )
    concurrency = _pick(o.concurrency, agents)
    num_apps = _pick(o.apps, concurrency)
    concurrency = min(concurrency, num_apps)
    params = {
        "turns": spec.turns,
        "context_tokens": spec.context_tokens,
        "max_tokens": spec.max_tokens,
        "tool_s": list(spec.tool_s),
    }
    arrival = _pick(o.arrival, "concurrent")
    rates = o.rates or [None]
    points = []
    for rate in rates:
        wl = make_workload(
            name=name,
            mix=o.mix or {SYNTHETIC_APP: 1.0},
            num_apps=num_apps,
            arrival=arrival if rate is None else (o.arrival or "poisson"),
            rate=rate,
            concurrency=concurrency,
            latency=_pick(o.latency, "paper"),
            seed=o.seed,
            llm=LLMSettings(max_tokens=spec.max_tokens),
            app_params={SYNTHETIC_APP: params},
            notes=(SYNTHETIC_DESCRIPTION,),
        )
        label = name if rate is None else f"{name}@{rate:g}/s"
        points.append(Point(label, wl))
    device = _pick(o.device_blocks, device_blocks)
    server = ServerConfig(
        model=o.model,
        device_blocks=device,
        # Never smaller than twice the constrained cache, whatever the estimate says.
        ideal_blocks=_pick(o.ideal_blocks, max(2 * device, _blocks_for_contexts(concurrency, spec))),
        host_pool_blocks=_pick(o.host_pool_blocks, 2 * _blocks_for_contexts(concurrency, spec)),
        extra_args=tuple(o.extra_server_args),
    )
    return _config(
        name,
        o,
        points=points,
        server=server,
        kv_interval_s=0.5,
        app_timeout_s=900.0,
        description=(
            f"{purpose}: {num_apps} "
            + (
                "synthetic multi-turn agent apps"
                if o.mix is None
                else "apps of " + ", ".join(f"{k}×{v:g}" for k, v in o.mix.items())
            )
            + f", {concurrency} at a time"
            + (f" (arrivals at {', '.join(f'{r:g}' for r in rates)}/s)" if rates != [None] else "")
            + f", ~{spec.context_tokens}-token private contexts, {spec.turns} turns, "
            f"{spec.tool_s[0]:g}-{spec.tool_s[1]:g} s tools, {spec.max_tokens} output tokens per turn, "
            f"{server.device_blocks} device KV blocks (ideal: {server.ideal_blocks})"
        ),
    )


def ci(o: Overrides) -> BenchConfig:
    return _multi_turn(
        "ci",
        o,
        agents=6,
        turns=3,
        context_tokens=1000,
        max_tokens=24,
        # Paper-like tool times (its tools take 0.1-10 s, most >= 4 s), nearly in lockstep so the agents'
        # next turns compete for the device KV at the same time. With 1-3 s tools the extension's gate
        # judges stalls too short on 2 CPU cores: stall_begin is handled at the next engine step, which
        # takes seconds while other agents prefill.
        tool_s=(3.5, 4.5),
        device_blocks=40,
        purpose="ci",
    )


def headroom(o: Overrides) -> BenchConfig:
    return _multi_turn(
        "headroom",
        o,
        agents=6,
        turns=6,
        context_tokens=1000,
        max_tokens=24,
        tool_s=(3.0, 3.0),
        device_blocks=40,
        purpose="headroom (research digest setup)",
    )


#: The stress preset's points: (label, preamble share of the base context, private share of the base).
#: In ``shared`` most of a worker's prompt (1,000 of ~1,600 tokens) is the same in every worker; the
#: private part stays large enough that the point still overfills the 40-block device KV.
STRESS_POINTS: tuple[tuple[str, float, float], ...] = (("hetero", 0.0, 1.0), ("shared", 5 / 6, 1 / 2))
STRESS_BASE_TOKENS = 1200
#: Apps per second of the stress preset's Poisson arrivals: a few seconds apart, so apps overlap.
STRESS_RATE = 0.25
_WORDS_TO_TOKENS = 1.25  # generous: the seeded text measures ~1.13 SmolLM2 tokens per word


def agent_mix_blocks(specs: list[agent_mix.AgentMixSpec]) -> tuple[int, int]:
    """(device blocks that never evict, host-pool blocks) for one point's ``agent_mix`` arrivals.

    Like :func:`_blocks_for_contexts`: every session's final context at once plus room for the largest
    one again and 8 spare blocks. The preamble is identical in every worker of every app, so the device
    holds it once (each worker's own part then starts in a fresh block); the host pool may hold a copy
    per worker, so its size counts the preamble per worker and doubles the total.
    """

    def blocks(tokens: float) -> int:
        return math.ceil(tokens / CPU_BLOCK_TOKENS)

    preamble = max((s.shared_prefix_tokens for s in specs), default=0) * _WORDS_TO_TOKENS
    sessions: list[int] = []
    host = 0
    for spec in specs:
        per_turn = spec.max_tokens + spec.tool_result_tokens + 40  # reply + tool result + question/template
        for worker in agent_mix.plan(spec):
            own = worker.private_tokens * _WORDS_TO_TOKENS + 64 + worker.turns * per_turn
            sessions.append(blocks(own) + 1)
            host += blocks(own + preamble)
        join = spec.workers * (spec.max_tokens * _WORDS_TO_TOKENS + 12) + 64 + spec.max_tokens
        sessions.append(blocks(join) + 1)
        host += blocks(join)
    ideal = blocks(preamble) + sum(sessions) + max(sessions, default=0) + 8
    return ideal, 2 * host


def stress(o: Overrides) -> BenchConfig:
    """The ``stress`` preset (see the module docstring and docs/benchmarks.md)."""
    base = _pick(o.context_tokens, STRESS_BASE_TOKENS)
    median = sum(o.tool_s) / 2 if o.tool_s else 3.0
    num_apps = _pick(o.apps, 3)
    rates = o.rates or [STRESS_RATE]
    arrival = _pick(o.arrival, "poisson")
    max_tokens = _pick(o.max_tokens, 24)
    chosen = STRESS_POINTS
    if o.points:
        unknown = sorted(set(o.points) - {label for label, *_ in STRESS_POINTS})
        if unknown:
            known = ", ".join(label for label, *_ in STRESS_POINTS)
            raise ValueError(f"unknown stress point(s) {', '.join(unknown)}; choose from {known}")
        chosen = tuple(p for p in STRESS_POINTS if p[0] in o.points)
    points: list[Point] = []
    for label, shared, private in chosen:
        params = {
            "workers": _pick(o.workers, 3),
            "turns": [o.turns, o.turns] if o.turns else [3, 5],
            "context_tokens": max(2, round(base * private)),
            "shared_prefix_tokens": round(base * shared),
            "max_tokens": max_tokens,
            "tool_median_s": median,
        }
        for rate in rates:
            wl = make_workload(
                name=f"stress-{label}",
                mix=o.mix or {AGENT_MIX_APP: 1.0},
                num_apps=num_apps,
                arrival=arrival,
                rate=rate,
                concurrency=o.concurrency,
                latency=_pick(o.latency, "paper"),
                seed=o.seed,
                llm=LLMSettings(max_tokens=max_tokens),
                app_params={AGENT_MIX_APP: params},
                notes=(agent_mix.DESCRIPTION,),
            )
            points.append(Point(label if o.rates is None else f"{label}@{rate:g}/s", wl))
    device = _pick(o.device_blocks, 40)
    sizes = [_agent_mix_sizes(p.workload) for p in points]
    # A mix with catalog apps cannot be sized here: the ideal then gets the server's default KV size.
    known = all(size is not None for size in sizes)
    ideal = max(size[0] for size in sizes if size) if known else None
    host = max(size[1] for size in sizes if size) if known else 512
    server = ServerConfig(
        model=o.model,
        device_blocks=device,
        ideal_blocks=_pick(o.ideal_blocks, None if ideal is None else max(2 * device, ideal)),
        host_pool_blocks=_pick(o.host_pool_blocks, host),
        extra_args=tuple(o.extra_server_args),
    )
    first = points[0].workload
    arrivals = (
        f"{first.concurrency} at a time"
        if first.arrival == "concurrent"
        else f"{first.arrival} arrivals at {', '.join(f'{r:g}' for r in rates)}/s"
    )
    _, shared_share, private_share = STRESS_POINTS[1]
    return _config(
        "stress",
        o,
        points=points,
        server=server,
        kv_interval_s=0.5,
        app_timeout_s=900.0,
        description=(
            f"stress: {num_apps} "
            + (
                f"fan-in app{'s' if num_apps != 1 else ''} of {_pick(o.workers, 3)} workers + join"
                if o.mix is None
                else "apps of " + ", ".join(f"{k}×{v:g}" for k, v in o.mix.items())
            )
            + f", {arrivals}; private contexts 0.5-1.5 × {base} tokens (shared: "
            f"{round(base * shared_share)}-token preamble + 0.5-1.5 × {round(base * private_share)}), "
            + (f"{o.turns} turns" if o.turns else "3-5 turns")
            + f", lognormal tools (median {median:g} s, sigma 0.6; one hint 2× low), {max_tokens} output "
            f"tokens per call, {server.device_blocks} device KV blocks (ideal: {server.ideal_blocks})"
        ),
    )


def _agent_mix_sizes(workload: Workload) -> tuple[int, int] | None:
    """:func:`agent_mix_blocks` of a workload made only of ``agent_mix`` apps, else None."""
    if any(a.app != AGENT_MIX_APP for a in workload.arrivals):
        return None
    return agent_mix_blocks([agent_mix.AgentMixSpec.from_params(a.params) for a in workload.arrivals])


PAPER_RATES = (0.05, 0.1, 0.2, 0.5, 1.0)
PAPER_APPS = ("code-writer", "deep-research")


def paper(o: Overrides) -> BenchConfig:
    rates = o.rates or list(PAPER_RATES)
    num_apps = _pick(o.apps, 10)
    points = []
    for rate in rates:
        wl = make_workload(
            name="paper",
            mix=o.mix or {app: 1.0 for app in PAPER_APPS},
            num_apps=num_apps,
            arrival=_pick(o.arrival, "poisson"),
            rate=rate,
            latency=_pick(o.latency, "paper"),
            seed=o.seed,
            llm=LLMSettings(max_tokens=o.max_tokens),
        )
        points.append(Point(f"{rate:g}/s", wl))
    server = ServerConfig(
        model=o.model,
        device_blocks=_pick(o.device_blocks, 64),
        ideal_blocks=o.ideal_blocks,
        host_pool_blocks=_pick(o.host_pool_blocks, 512),
        extra_args=tuple(o.extra_server_args),
    )
    return _config(
        "paper",
        o,
        points=points,
        server=server,
        kv_interval_s=1.0,
        app_timeout_s=3600.0,
        description=(
            f"paper: Code-Writer + Deep-Research (catalog), {num_apps} apps per point, "
            f"{_pick(o.latency, 'paper')} tool times, Poisson arrivals at "
            f"{', '.join(f'{r:g}' for r in rates)} apps/s, "
            f"{server.device_blocks} device KV blocks"
        ),
    )


@dataclass(frozen=True)
class CatalogFootprint:
    """Estimated KV footprint of one catalog app run at ``context=realistic`` (tokens).

    Every session's final context with each answer at its full ``max_tokens`` (the benchmark forces
    that with ``ignore_eos``), estimated high (``tokencake.agents.catalog._material``). ``parallel``
    is the widest stage: sessions that are live side by side, each idle during its tool calls.
    ``tests/bench/test_presets_catalog.py`` checks these numbers against scripted runs.
    """

    #: All sessions of the run together (what a never-evicting cache ends up holding).
    total: int
    #: The sessions of the widest stage together.
    parallel: int
    #: What that stage is.
    stage: str


#: The ``catalog`` preset's apps in arrival order; ``--apps N`` cycles through them.
CATALOG_APPS = ("deep-research", "code-writer")
#: The context level the preset builds every catalog app with.
CATALOG_CONTEXT = "realistic"
CATALOG_FOOTPRINT = {
    "deep-research": CatalogFootprint(total=12_700, parallel=8_300, stage="3 researchers, 2 documents each"),
    "code-writer": CatalogFootprint(total=32_000, parallel=7_600, stage="3 programmer chains"),
}


def catalog_pressure(config: BenchConfig) -> dict[str, int]:
    """Estimated device pressure of a ``catalog`` point (tokens): device, peak, all sessions.

    ``peak``: apps that arrive together run their stages in lockstep, so the widest stage of one app
    is live in every arrival of that app at once; the peak is at least the largest such sum (a lower
    bound: the other apps' sessions of the moment are not counted). ``total``: every session's final
    context, the size of a cache that never evicts.
    """
    workload = config.points[0].workload
    counts: dict[str, int] = {}
    for arrival in workload.arrivals:
        counts[arrival.app] = counts.get(arrival.app, 0) + 1
    known = {app: n for app, n in counts.items() if app in CATALOG_FOOTPRINT}
    peak = max((CATALOG_FOOTPRINT[app].parallel * n for app, n in known.items()), default=0)
    total = sum(CATALOG_FOOTPRINT[app].total * n for app, n in known.items())
    return {"device": config.server.device_blocks * CPU_BLOCK_TOKENS, "peak": peak, "total": total}


def catalog(o: Overrides) -> BenchConfig:
    """The ``catalog`` preset: realistic-context catalog apps arriving together on 40 device blocks."""
    num_apps = _pick(o.apps, len(CATALOG_APPS))
    rates = o.rates or [None]
    arrival = _pick(o.arrival, "concurrent")
    mix = o.mix or {app: 1.0 for app in CATALOG_APPS}
    catalog_apps = [app for app in mix if app not in SYNTHETIC_APPS]
    points = []
    for rate in rates:
        wl = make_workload(
            name="catalog",
            mix=mix,
            num_apps=num_apps,
            arrival=arrival if rate is None else (o.arrival or "poisson"),
            rate=rate,
            concurrency=o.concurrency,
            latency=_pick(o.latency, "paper"),
            seed=o.seed,
            llm=LLMSettings(max_tokens=o.max_tokens),
            app_params={app: {"context": CATALOG_CONTEXT} for app in catalog_apps},
            sequence=None if o.mix else CATALOG_APPS,
            notes=(
                f"catalog apps with context={CATALOG_CONTEXT}: agents carry the documents, files and "
                "test logs their tools return (seeded synthetic text, ~2.5-2.8k tokens per agent)",
            ),
        )
        points.append(Point("catalog" if rate is None else f"catalog@{rate:g}/s", wl))
    device = _pick(o.device_blocks, 40)
    apps = [a.app for a in points[0].workload.arrivals]
    # Sized like the synthetic presets: every session's final context at once, plus 8 spare blocks.
    # Other apps in --mix cannot be sized here: the ideal then gets the server's default KV size.
    ideal = None
    if all(app in CATALOG_FOOTPRINT for app in apps):
        blocks = sum(math.ceil(CATALOG_FOOTPRINT[app].total / CPU_BLOCK_TOKENS) for app in apps) + 8
        ideal = max(2 * device, blocks)
    server = ServerConfig(
        model=o.model,
        device_blocks=device,
        ideal_blocks=_pick(o.ideal_blocks, ideal),
        host_pool_blocks=_pick(o.host_pool_blocks, 2 * ideal if ideal else 512),
        extra_args=tuple(o.extra_server_args),
    )
    first = points[0].workload
    arrivals = (
        f"arriving together ({first.concurrency} at a time)"
        if first.arrival == "concurrent"
        else f"{first.arrival} arrivals at {', '.join(f'{r:g}' for r in rates if r)}/s"
    )
    return _config(
        "catalog",
        o,
        points=points,
        server=server,
        kv_interval_s=0.5,
        app_timeout_s=1800.0,
        description=(
            f"catalog: {num_apps} apps ("
            + ", ".join(a.app for a in first.arrivals)
            + f") with realistic contexts, {arrivals}, {_pick(o.latency, 'paper')} tool times, "
            f"{server.device_blocks} device KV blocks (ideal: {server.ideal_blocks})"
        ),
    )


PRESETS = {"ci": ci, "headroom": headroom, "stress": stress, "paper": paper, "catalog": catalog}


def build(name: str, overrides: Overrides | None = None) -> BenchConfig:
    """The named preset with ``overrides`` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name](overrides or Overrides())
