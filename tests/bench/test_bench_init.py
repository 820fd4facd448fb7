"""``tokencake.bench``'s public names: the package's API, whichever module defines each."""

from __future__ import annotations

import tokencake.bench as bench

PUBLIC = [
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


def test_the_public_names_are_pinned_and_importable() -> None:
    assert bench.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(bench, name) is not None, name
