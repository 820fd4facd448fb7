"""``tokencake sim`` from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokencake.cli import _sim, main
from tokencake.sim import PROFILES, SYSTEMS


def test_the_parser_knows_every_profile_and_system() -> None:
    assert set(_sim.PROFILE_NAMES) == set(PROFILES)
    assert set(_sim.DEFAULT_SYSTEMS.split(",")) <= set(SYSTEMS)


def test_a_sweep_writes_results_and_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    rc = main(
        [
            "sim",
            "--preset",
            "stress",
            "--agents",
            "2,4",
            "--turns",
            "3",
            "--policies",
            "baseline,tokencake,ideal",
            "--out",
            str(out),
            "--write-trace",
            str(tmp_path / "t.jsonl"),
        ]
    )
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert [p["agents"] for p in doc["points"]] == [2, 4]
    assert set(doc["points"][0]["systems"]) == {"baseline", "tokencake", "ideal"}
    assert (out / "sim.png").stat().st_size > 0
    assert "git_commit" in doc and "git_dirty" in doc  # which code made the numbers
    # The trace written can be replayed as is.
    assert (
        main(
            [
                "sim",
                "--trace",
                str(tmp_path / "t.jsonl"),
                "--policies",
                "baseline",
                "--json",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    assert "tokencake sim" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--policies", "nope"], "unknown system"),
        (["--agents", "x"], "--agents"),
        (["--agents", "0"], "--agents"),
        (["--trace", "/nonexistent.jsonl"], "nonexistent"),
        (["--rate", "0"], "--rate"),
        (["--turns", "0"], "--turns"),
        (["--set", "flops=3"], "NAME=VALUE"),
        (["--set", "step_s=fast"], "not a number"),
        (["--set", "max_num_seqs=1e400"], "not a number"),
        (["--set", "d2h_bytes_per_s=0"], "> 0"),
    ],
)
def test_bad_input_is_one_clear_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_validate_passes_and_reports_the_held_out_runs_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "v.json"
    assert main(["sim", "--validate", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "OK" in text and "held-out runs (the test): worst" in text and "fitted runs (not a test)" in text
    doc = json.loads(out.read_text())
    assert set(doc["errors"]) == {"held_out", "fitted"}
    assert doc["errors"]["held_out"]["worst"] <= doc["worst_error"]
    assert {r["fitted"] for r in doc["rows"].values()} == {True, False}
    assert doc["runs"]["ci"]["fitted"] and not doc["runs"]["stress"]["fitted"]
    assert "git_commit" in doc and "vllm" in doc
    assert doc["command"] == "tokencake sim --validate --json v.json"


def test_validate_reads_the_runs_dir_and_refuses_one_without_the_runs_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gzip

    from tokencake.sim.stored import FIXTURES

    assert main(["sim", "--validate", "--runs-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokencake: error: stored run ") and err.count("\n") == 1
    assert str(tmp_path) in err
    for fixture in FIXTURES.values():  # a compact copy is a results file with only what is read
        (tmp_path / fixture.results_name).write_bytes(gzip.decompress(fixture.path.read_bytes()))
    assert main(["sim", "--validate", "--runs-dir", str(tmp_path)]) == 0
    assert "OK" in capsys.readouterr().out


def test_a_recorded_run_replays(tmp_path: Path) -> None:
    trace = tmp_path / "dr.jsonl"
    assert main(["run", "deep-research", "--scripted", "--no-live", "--json", "--trace", str(trace)]) == 0
    from tokencake.sim import Trace

    recorded = Trace.read_jsonl(trace)
    (app,) = recorded.apps
    assert {n.name for n in app.nodes} >= {"planner", "writer"} and recorded.num_llm_calls >= 4
    assert main(["sim", "--trace", str(trace), "--policies", "baseline,tokencake", "--jobs", "1"]) == 0


def test_a_profile_constant_can_be_overridden_and_the_results_say_so(tmp_path: Path) -> None:
    """``--set``: a sensitivity run (here a decode twice as slow per context token) changes the
    modelled times and is named in the results, never passed off as the profile itself."""
    times = {}
    for extra in ([], ["--set", "decode_s_per_ctx_token=6.8e-8", "--set", "max_num_seqs=64"]):
        out = tmp_path / f"r{len(extra)}.json"
        argv = ["sim", "--profile", "h200-llama3-8b", "--preset", "stress", "--agents", "4", "--turns", "2"]
        assert main([*argv, "--policies", "baseline", "--json", str(out), *extra]) == 0
        doc = json.loads(out.read_text())
        times[len(extra)] = (doc["profile"], doc["points"][0]["systems"]["baseline"]["e2e_mean_s"])
    assert times[0][0] == "h200-llama3-8b"
    assert times[4][0] == "h200-llama3-8b+decode_s_per_ctx_token=6.8e-08,max_num_seqs=64"
    assert times[4][1] > times[0][1]
