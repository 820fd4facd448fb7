"""Turn a workload :class:`~tokencake.bench.workload.Arrival` into a runnable SDK app and its inputs.

Two sources: the synthetic apps (``multi_turn`` from :mod:`tokencake.bench.synthetic`, ``agent_mix``
from :mod:`tokencake.bench.agent_mix`) and the bundled catalog (``tokencake.agents.catalog.get_app``).
A fresh app object is built for every arrival and every system, so per-app state (seeded latency noise
counters, sandboxes) never leaks between systems.
"""

from __future__ import annotations

import random
from typing import Any

from tokencake.bench import agent_mix
from tokencake.bench.synthetic import MultiTurnSpec, build_app
from tokencake.bench.workload import AGENT_MIX_APP, SYNTHETIC_APP, SYNTHETIC_APPS, Arrival, parse_latency


def available_apps() -> list[str]:
    """The synthetic apps plus every catalog app."""
    from tokencake.agents.catalog import app_names

    return [*SYNTHETIC_APPS, *app_names()]


def default_inputs(app: str, index: int, rng: random.Random) -> dict[str, Any]:
    """Run inputs of arrival ``index``: none for a synthetic app, the catalog's default task else.

    Every arrival of a catalog app gets the same task: the seeded parts of a workload are the arrival
    times, the app mix and the tool-latency noise.
    """
    if app in SYNTHETIC_APPS:
        return {}
    from tokencake.agents.catalog import default_inputs as catalog_inputs

    return catalog_inputs(app)


def build(arrival: Arrival, latency: str) -> Any:
    """A fresh ``tokencake.App`` for ``arrival`` with tool latencies in mode ``latency``."""
    kind, scale = parse_latency(latency)
    # The synthetic tools are sleeps, so "real" and "paper" both mean their nominal durations.
    latency_scale = scale if kind == "scaled" else 1.0
    if arrival.app == SYNTHETIC_APP:
        return build_app(MultiTurnSpec.from_params(arrival.params), latency_scale=latency_scale)
    if arrival.app == AGENT_MIX_APP:
        spec = agent_mix.AgentMixSpec.from_params(arrival.params)
        return agent_mix.build_app(spec, latency_scale=latency_scale)
    from tokencake.agents.catalog import get_app

    return get_app(arrival.app, latency=latency, **arrival.params)
