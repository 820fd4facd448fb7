"""The stored real runs as compact package data (tokencake/sim/stored.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tokencake.sim.stored import (
    FIXTURES,
    PACKAGED,
    REPLAYED,
    StoredRunsMissing,
    compact,
    fixtures_in,
    read_results,
    write_compact,
)
from tokencake.sim.validate import validate

BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"
NAMES = [*dict.fromkeys(f.results_name for f in FIXTURES.values()), *REPLAYED]
#: The stored runs whose results file docs/bench keeps (trimmed: benchmarks/trim_results.py).
IN_BENCH = [name for name in NAMES if (BENCH / name).is_file()]


def test_the_stored_runs_are_read_from_package_data_by_default() -> None:
    assert all(f.path.name == f"{f.results_name}.gz" for f in FIXTURES.values())
    assert all((PACKAGED / f"{name}.gz").is_file() for name in NAMES)
    assert {f.path.parent.name for f in FIXTURES.values()} == {"fixtures"}
    total = sum(len((PACKAGED / f"{name}.gz").read_bytes()) for name in NAMES)
    assert total < 1_000_000, total


def _calls_emptied(doc: dict) -> dict:
    for point in doc["points"]:
        for system in point["systems"].values():
            if "calls" in system:
                system["calls"] = []
    return doc


@pytest.mark.skipif(not IN_BENCH, reason="docs/bench keeps no results file of a stored run")
def test_the_packaged_copies_agree_with_the_results_files_docs_bench_keeps() -> None:
    """A packaged copy is the compact of its run's results file: exactly where the file is full,
    and on all but the calls where it is trimmed (a trimmed file has none)."""
    for name in IN_BENCH:
        stored = read_results(BENCH / name)
        packaged = read_results(PACKAGED / f"{name}.gz")
        again = compact(stored, name)
        if stored.get("trimmed"):
            again, packaged = _calls_emptied(again), _calls_emptied(packaged)
        assert again == packaged, name


def test_write_compact_rewrites_from_full_files_and_keeps_the_copy_of_a_trimmed_or_absent_one(
    tmp_path: Path,
) -> None:
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    full = FIXTURES["ci"]
    (runs / full.results_name).write_bytes(gzip.decompress(full.path.read_bytes()))
    trimmed = json.loads(gzip.decompress(FIXTURES["stress"].path.read_bytes())) | {"trimmed": {"dropped": []}}
    (runs / FIXTURES["stress"].results_name).write_text(json.dumps(trimmed))
    assert [p.name for p in write_compact(runs, out)] == [full.path.name]
    expected = compact(read_results(runs / full.results_name), full.results_name)
    assert read_results(out / full.path.name) == expected


def test_compact_keeps_what_the_trace_and_the_check_read_and_drops_the_rest() -> None:
    kept_call = {"run_id": "r", "node": "w", "started": 1.0, "status": 200, "prompt_tokens": 9}
    kept_call["completion_tokens"] = 2
    call = {**kept_call, "text_sha1": "x", "latency_s": 0.5}
    kept_summary = {"offload_bytes": 8.0, "offload_s": 1.0, "upload_bytes": 4.0, "upload_s": 1.0}
    app = {"run_id": "r", "arrival_s": 0.0, "e2e_s": 3.0, "nodes": {"w": {}}}
    summary = {**kept_summary, "holds": 3}
    arrival = {"index": 0, "at_s": 0.0, "app": "multi_turn", "params": {"turns": 1}, "run_id": "r"}
    point = {
        "label": "ci#1",
        "base_label": "ci",
        "workload": {"latency": "paper", "arrival": "concurrent", "arrivals": [arrival], "seed": 0},
        "systems": {
            "baseline": {"apps": [app], "calls": [call], "server": {}},
            "tokencake": {"apps": [app], "calls": [call], "extension": {"summary": summary}},
        },
    }
    again = {**point, "label": "ci#2"}
    results = {
        "config": {
            "server": {"device_blocks": 40, "ideal_blocks": 99, "host_pool_blocks": 198, "eager": True},
            "systems": [{"name": "tokencake", "scheduler": "S", "flags": {}}],
        },
        "points": [point, again],
        "aggregate": {"ci": {"paired": {"tokencake/ideal": {"ratio": 0.9, "ci95": [0.8, 1.0], "n": 3}}}},
        "versions": {"git_commit": "abc"},
    }
    out = compact(results, "x-results.json")
    assert (out["source"], out["git_commit"]) == ("x-results.json", "abc")
    assert out["config"]["server"] == {"device_blocks": 40, "ideal_blocks": 99, "host_pool_blocks": 198}
    assert out["config"]["systems"] == [{"name": "tokencake", "scheduler": "S"}]
    first, second = out["points"]
    assert first["workload"]["arrivals"] == [{k: arrival[k] for k in ("run_id", "at_s", "app", "params")}]
    assert "workload" not in second  # a later round of the same point: only its measurements
    # Calls only of the system the trace is rebuilt from, on the point's first round.
    assert first["systems"]["baseline"]["calls"] == [kept_call]
    assert "calls" not in first["systems"]["tokencake"] and "calls" not in second["systems"]["baseline"]
    assert second["systems"]["tokencake"]["apps"] == [{"run_id": "r", "arrival_s": 0.0, "e2e_s": 3.0}]
    assert second["systems"]["tokencake"]["extension"]["summary"] == kept_summary
    assert out["aggregate"]["ci"]["paired"]["tokencake/ideal"] == {"ratio": 0.9, "ci95": [0.8, 1.0]}


def test_fixtures_in_reads_full_results_files_from_a_directory(tmp_path: Path) -> None:
    ci = FIXTURES["ci"]
    (tmp_path / "ci-results.json").write_bytes(gzip.decompress(ci.path.read_bytes()))
    moved = fixtures_in(tmp_path)
    assert set(moved) == set(FIXTURES)
    assert moved["ci"].path == tmp_path / "ci-results.json"
    assert (moved["ci"].profile, moved["ci"].fitted) == (ci.profile, ci.fitted)
    assert read_results(moved["ci"].path) == json.loads(gzip.decompress(ci.path.read_bytes()))
    assert validate({"ci": moved["ci"]}) == validate({"ci": ci})


def test_a_missing_stored_run_is_a_one_line_error_that_says_where_to_look(tmp_path: Path) -> None:
    with pytest.raises(StoredRunsMissing) as raised:
        validate(fixtures_in(tmp_path / "absent"))
    message = str(raised.value)
    assert isinstance(raised.value, FileNotFoundError)
    assert "\n" not in message and str(tmp_path / "absent") in message
    assert "docs/bench" in message and "--runs-dir" in message
    with pytest.raises(StoredRunsMissing, match="fixtures"):
        read_results(PACKAGED / "absent-results.json.gz")
