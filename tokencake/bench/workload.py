"""A benchmark workload: which apps arrive when, with which inputs and tool latencies.

A :class:`Workload` is generated once from a seed and then replayed unchanged against every system, so
the systems differ only in the server they talk to. It is plain data (JSON round trip through
:meth:`Workload.to_dict` / :meth:`Workload.from_dict`) and is stored in ``results.json``, which makes a
run reproducible from its output alone.

Arrival processes:

* ``poisson`` — open loop, exponential inter-arrival times at ``rate`` apps/s (the paper's setting);
* ``uniform`` — open loop, one app every ``1 / rate`` seconds (the public port's setting);
* ``concurrent`` — closed loop, ``concurrency`` apps in flight; each finished app starts the next one
  until ``num_apps`` have run (``num_apps == concurrency`` starts them all at once).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

ArrivalKind = Literal["poisson", "uniform", "concurrent"]
ARRIVAL_KINDS: tuple[str, ...] = ("poisson", "uniform", "concurrent")

#: The synthetic app built by :mod:`tokencake.bench.synthetic` (not from the catalog).
SYNTHETIC_APP = "multi_turn"
#: The synthetic fan-in app built by :mod:`tokencake.bench.agent_mix` (the ``stress`` preset).
AGENT_MIX_APP = "agent_mix"
#: Apps built by this package rather than taken from the catalog; they take no run inputs.
SYNTHETIC_APPS: tuple[str, ...] = (SYNTHETIC_APP, AGENT_MIX_APP)


@dataclass(frozen=True)
class Arrival:
    """One app run of the workload."""

    index: int
    #: Seconds after the start of the replay (open loop); 0 for closed-loop arrivals.
    at_s: float
    app: str
    #: Factory parameters of the app (catalog ``get_app`` keywords or the synthetic app's knobs).
    params: dict[str, Any]
    #: Run inputs passed to ``app.run``.
    inputs: dict[str, Any]
    #: Identical for every system so per-call results can be matched across systems.
    run_id: str


@dataclass(frozen=True)
class LLMSettings:
    """Request fields forced on every chat completion so all systems do exactly the same work."""

    temperature: float = 0.0
    ignore_eos: bool = True
    #: Overrides each agent's own ``max_tokens`` when set.
    max_tokens: int | None = None

    def overrides(self) -> dict[str, Any]:
        """The JSON body fields to force onto every chat completion request."""
        body: dict[str, Any] = {"temperature": self.temperature, "ignore_eos": self.ignore_eos}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return body


@dataclass(frozen=True)
class Workload:
    """A seeded, serialisable list of app arrivals (see the module docstring)."""

    name: str
    seed: int
    arrival: ArrivalKind
    num_apps: int
    #: Apps per second for open-loop arrivals.
    rate: float | None
    #: Apps in flight for closed-loop arrivals.
    concurrency: int | None
    #: App name -> weight.
    mix: dict[str, float]
    #: Tool latency mode: ``real``, ``paper`` or ``scaled:X``.
    latency: str
    llm: LLMSettings
    arrivals: tuple[Arrival, ...]
    #: Free-form facts worth keeping next to the numbers (e.g. "synthetic app: ...").
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def apps(self) -> list[str]:
        """Distinct app names in arrival order."""
        return list(dict.fromkeys(a.app for a in self.arrivals))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["arrivals"] = [asdict(a) for a in self.arrivals]
        data["notes"] = list(self.notes)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Workload:
        arrivals = tuple(Arrival(**a) for a in data["arrivals"])
        return cls(
            name=data["name"],
            seed=int(data["seed"]),
            arrival=data["arrival"],
            num_apps=int(data["num_apps"]),
            rate=data.get("rate"),
            concurrency=data.get("concurrency"),
            mix=dict(data["mix"]),
            latency=data["latency"],
            llm=LLMSettings(**data.get("llm", {})),
            arrivals=arrivals,
            notes=tuple(data.get("notes", ())),
        )


def parse_latency(mode: str) -> tuple[str, float]:
    """Validate a latency mode; returns ``(kind, scale)``: ``real``/``paper`` scale 1, ``scaled:X`` → X."""
    if mode in ("real", "paper"):
        return mode, 1.0
    if mode.startswith("scaled:"):
        try:
            scale = float(mode.split(":", 1)[1])
        except ValueError:
            scale = -1.0
        if scale > 0:
            return "scaled", scale
    raise ValueError(f"latency mode must be 'real', 'paper' or 'scaled:X' with X > 0, got {mode!r}")


def arrival_times(kind: str, num_apps: int, rate: float | None, rng: random.Random) -> list[float]:
    """Start offsets (seconds) of ``num_apps`` apps; closed-loop arrivals are all 0."""
    if num_apps < 1:
        raise ValueError("num_apps must be >= 1")
    if kind == "concurrent":
        return [0.0] * num_apps
    if kind not in ARRIVAL_KINDS:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVAL_KINDS)}, got {kind!r}")
    if rate is None or rate <= 0:
        raise ValueError(f"{kind} arrivals need a rate > 0 (apps/s)")
    times: list[float] = []
    t = 0.0
    for i in range(num_apps):
        if i:
            t += rng.expovariate(rate) if kind == "poisson" else 1.0 / rate
        times.append(round(t, 6))
    return times


def pick_apps(mix: Mapping[str, float], num_apps: int, rng: random.Random) -> list[str]:
    """Draw ``num_apps`` app names by weight (a single-app mix needs no randomness)."""
    names = [n for n, w in mix.items() if w > 0]
    if not names:
        raise ValueError("the app mix needs at least one app with a positive weight")
    if len(names) == 1:
        return names * num_apps
    return rng.choices(names, weights=[mix[n] for n in names], k=num_apps)


def make_workload(
    *,
    name: str,
    mix: Mapping[str, float],
    num_apps: int,
    arrival: str = "concurrent",
    rate: float | None = None,
    concurrency: int | None = None,
    latency: str = "paper",
    seed: int = 0,
    llm: LLMSettings | None = None,
    app_params: Mapping[str, Mapping[str, Any]] | None = None,
    inputs_for: Any = None,
    notes: tuple[str, ...] = (),
    sequence: tuple[str, ...] | None = None,
) -> Workload:
    """Generate a workload.

    ``sequence`` fixes the apps instead of drawing them from ``mix``: arrival ``i`` runs
    ``sequence[i % len(sequence)]`` (a preset whose composition must not depend on the seed).
    ``app_params`` maps an app name to its factory keywords. ``inputs_for(app, index, rng)`` returns the
    run inputs of one arrival (default: :func:`tokencake.bench.apps.default_inputs`); every arrival gets
    its own ``seed`` parameter so seeded tool-latency noise differs between apps but not between systems.
    """
    parse_latency(latency)
    if arrival == "concurrent":
        if concurrency is None:
            concurrency = num_apps
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        rate = None
    else:
        concurrency = None
    if inputs_for is None:
        from tokencake.bench.apps import default_inputs

        inputs_for = default_inputs
    rng = random.Random(f"tokencake-bench:{seed}")
    times = arrival_times(arrival, num_apps, rate, rng)
    if sequence:
        names = [sequence[i % len(sequence)] for i in range(num_apps)]
    else:
        names = pick_apps(mix, num_apps, rng)
    params_by_app = {k: dict(v) for k, v in (app_params or {}).items()}
    arrivals = []
    for i, (t, app) in enumerate(zip(times, names, strict=True)):
        params = {**params_by_app.get(app, {}), "seed": seed * 100_003 + i}
        arrivals.append(
            Arrival(
                index=i,
                at_s=t,
                app=app,
                params=params,
                inputs=dict(inputs_for(app, i, rng)),
                run_id=f"{name}-{i:04d}",
            )
        )
    return Workload(
        name=name,
        seed=seed,
        arrival=arrival,  # type: ignore[arg-type]
        num_apps=num_apps,
        rate=rate,
        concurrency=concurrency,
        mix=dict(mix),
        latency=latency,
        llm=llm or LLMSettings(),
        arrivals=tuple(arrivals),
        notes=tuple(notes),
    )
