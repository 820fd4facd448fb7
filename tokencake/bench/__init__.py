"""``tokencake bench``: replay one seeded agent workload against stock vLLM, TokenCake and the ideal.

Modules, read top-down: :mod:`.workload` (what arrives when), :mod:`.synthetic` (the multi-turn agent
app), :mod:`.agent_mix` (the fan-in app of the stress preset), :mod:`.apps` (arrival → SDK app),
:mod:`.systems` (what is compared), :mod:`.calls` (per-call records under the SDK), :mod:`.metrics` (the
numbers), :mod:`.intervals` (confidence intervals over rounds), :mod:`.runner` (replays),
:mod:`.report` (files and tables), :mod:`.presets` (ci / headroom / stress / paper), :mod:`.schema`
(results.json).
"""

from tokencake.bench.metrics import equal_work, percentile, summarize
from tokencake.bench.presets import PRESETS, Overrides, build
from tokencake.bench.report import render, write_all
from tokencake.bench.runner import BenchConfig, Point, run_bench
from tokencake.bench.schema import RESULTS_SCHEMA
from tokencake.bench.systems import SYSTEMS, ServerConfig, SystemSpec, resolve_systems
from tokencake.bench.workload import Arrival, LLMSettings, Workload, make_workload

__all__ = [
    "PRESETS",
    "RESULTS_SCHEMA",
    "SYSTEMS",
    "Arrival",
    "BenchConfig",
    "LLMSettings",
    "Overrides",
    "Point",
    "ServerConfig",
    "SystemSpec",
    "Workload",
    "build",
    "equal_work",
    "make_workload",
    "percentile",
    "render",
    "resolve_systems",
    "run_bench",
    "summarize",
    "write_all",
]
