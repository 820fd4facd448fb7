"""The stored real runs as compact package data (tokencake/sim/stored.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tokencake.sim.stored import (
    FIXTURES,
    PACKAGED,
    StoredRunsMissing,
    compact,
    fixtures_in,
    read_results,
    write_compact,
)
from tokencake.sim.validate import validate

BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"
#: The full results files this clone still has (the compact copies stand in for them elsewhere).
FULL = [n for n, f in FIXTURES.items() if (BENCH / f.results_name).is_file()]


def test_the_stored_runs_are_read_from_package_data_by_default() -> None:
    assert all(f.path.name == f"{f.results_name}.gz" for f in FIXTURES.values())
    assert all(f.path.is_file() for f in FIXTURES.values())
    assert {f.path.parent.name for f in FIXTURES.values()} == {"fixtures"}
    total = sum(len(f.path.read_bytes()) for f in FIXTURES.values())
    assert total < 1_000_000, total


@pytest.mark.skipif(not FULL, reason="no full results file of FIXTURES in docs/bench")
def test_validation_from_the_compact_copies_gives_exactly_the_rows_of_the_full_files() -> None:
    full = fixtures_in(BENCH)
    for name in FULL:
        assert validate({name: FIXTURES[name]}) == validate({name: full[name]}), name


@pytest.mark.skipif(not FULL, reason="no full results file of FIXTURES in docs/bench")
def test_the_packaged_copies_are_the_compact_of_the_full_files(tmp_path: Path) -> None:
    """``python -m tokencake.sim.stored docs/bench`` was run after the last change to a stored run."""
    written = {p.name: p for p in write_compact(BENCH, tmp_path)}
    for name in FULL:
        fixture = FIXTURES[name]
        assert written[fixture.path.name].read_bytes() == fixture.path.read_bytes(), name


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
