"""``benchmarks/trim_results.py``: a stored run keeps what its comparisons and quoted numbers read."""

import copy
import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "trim_results.py"
_spec = importlib.util.spec_from_file_location("trim_results", _PATH)
trim_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trim_results)

BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"


def _run() -> dict:
    app = {"run_id": "r", "arrival_s": 0.0, "status": "ok", "e2e_s": 3.0, "nodes": {"w": {"llm_s": 1.0}}}
    system = {
        "apps": [app],
        "calls": [{"run_id": "r", "node": "w"}],
        "kv": [[0.0, 0.5]],
        "client": {"apps": 1},
        "server": {"computed_prompt_tokens": 9},
        "extension": {"summary": {"ready_rate": 0.5}, "delta": {"x": 1}, "after": {"y": 2}},
        "replay_s": 10.0,
    }
    point = {"label": "ci#1", "workload": {"seed": 3}, "systems": {"tokencake": system}}
    return {"kind": "tokencake-bench", "points": [point], "aggregate": {"ci": {}}}


def test_trim_drops_the_raw_records_and_keeps_what_the_aggregation_reads() -> None:
    run = _run()
    out = trim_results.trim(copy.deepcopy(run), "abc")
    system = out["points"][0]["systems"]["tokencake"]
    assert set(system) == {"apps", "client", "server", "extension", "replay_s"}
    assert system["apps"] == [{"run_id": "r", "arrival_s": 0.0, "status": "ok", "e2e_s": 3.0}]
    assert system["extension"] == {"summary": {"ready_rate": 0.5}}
    assert out["points"][0]["workload"] == {"seed": 3} and out["aggregate"] == {"ci": {}}
    assert out["trimmed"] == {
        "dropped": ["calls", "kv", "extension.delta", "extension.after", "apps.nodes"],
        "full_at": "abc",
    }
    assert trim_results.trim(copy.deepcopy(out), "other") == out  # trimmed once: left as it is


def test_every_trimmed_file_in_docs_bench_names_the_commit_that_holds_the_full_file() -> None:
    trimmed = [json.loads(p.read_text()) for p in sorted(BENCH.glob("*-results.json"))]
    trimmed = [r["trimmed"] for r in trimmed if "trimmed" in r]
    assert trimmed
    assert all(len(t["full_at"] or "") == 40 for t in trimmed)
