"""The report's files, written from a stored run alone."""

import csv
import json

from tokencake.bench.report import write_all


def test_a_stored_run_is_written_to_json_csv_and_markdown(pooled_results, tmp_path):
    for point in pooled_results["points"]:
        for name, s in point["systems"].items():
            s["calls"] = [{"key": f"{name}/n/0", "status": 200, "latency_s": 1.0}]
    written = write_all(pooled_results, tmp_path, plots=False)
    assert [p.name for p in written] == ["results.json", "summary.csv", "calls.csv", "summary.md"]
    assert json.loads((tmp_path / "results.json").read_text())["aggregate"]["p"]["repeats"] == 3
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert len(rows) == 3 * 4 and rows[0]["point"] == "p#1" and rows[0]["system"] == "baseline"
    assert float(rows[0]["e2e_mean_s"]) == 20.0
    assert len(list(csv.DictReader((tmp_path / "calls.csv").open()))) == 3 * 4
    assert (tmp_path / "summary.md").read_text().startswith("# tokencake bench · stress")
