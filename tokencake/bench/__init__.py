"""``tokencake bench``: replay one seeded agent workload against stock vLLM, TokenCake and the ideal.

Modules, read top-down: :mod:`.workload` (what arrives when), :mod:`.synthetic` (the multi-turn agent
app), :mod:`.agent_mix` (the fan-in app of the stress preset), :mod:`.apps` (arrival → SDK app),
:mod:`.systems` (what is compared; the registry ``tokencake sim`` shares), :mod:`.calls` (per-call
records under the SDK); the numbers: :mod:`.metrics` (statistics, client side), :mod:`.server_metrics`
(vLLM's ``/metrics``), :mod:`.kv_sampler` (KV usage over time), :mod:`.extension_stats` (``/v1/stats``),
:mod:`.equal_work_check`; the runs: :mod:`.replay` (one workload on one server), :mod:`.runner` (every
point on every system), :mod:`.compare` (one point's ratios), :mod:`.rounds` (rounds pooled),
:mod:`.intervals` (confidence intervals), :mod:`.environment` (versions, machine); the output:
:mod:`.report` (files), :mod:`.tables`, :mod:`.terminal`, :mod:`.markdown`, :mod:`.plots`;
:mod:`.presets` (ci / headroom / stress / paper / catalog), :mod:`.schema` (results.json).
"""

from tokencake.bench.equal_work_check import equal_work
from tokencake.bench.metrics import percentile, summarize
from tokencake.bench.presets import PRESETS, Overrides, build
from tokencake.bench.report import write_all
from tokencake.bench.runner import BenchConfig, Point, run_bench
from tokencake.bench.schema import RESULTS_SCHEMA
from tokencake.bench.systems import SYSTEMS, ServerConfig, SystemSpec, resolve_systems
from tokencake.bench.terminal import render
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
