"""The GPU profiles against the H200 measurements (tokencake/sim/calibrate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokencake.sim.calibrate import (
    LAUNCH_MARGIN,
    STEP_CONSTANTS,
    StepCase,
    compact_measurements,
    fit_copies,
    fit_step,
    fitted_cases,
    launch_bound,
    leave_one_out,
    measurements,
    step_cases,
    step_errors,
)
from tokencake.sim.profiles import get_profile

H200 = get_profile("h200-llama3-8b")
H100 = get_profile("h100-llama3-8b")
BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"


def test_the_h200_step_constants_are_the_fit_to_its_measured_steps() -> None:
    params = fit_step(fitted_cases(step_cases()))
    for name in STEP_CONSTANTS:  # stored to 3 significant digits
        assert getattr(H200, name) == pytest.approx(params[name], rel=5e-3), name


def test_the_h200_step_model_is_within_10_percent_of_every_measured_step_but_the_launch_bound() -> None:
    rows = step_errors(H200)
    assert len(rows) == 17 and sum(r["fitted"] for r in rows) == 13
    for r in rows:
        if r["fitted"]:
            assert abs(r["error"]) <= 0.10, r
        else:  # the eager forward's launch floor (~11 ms), which vLLM's CUDA graphs remove
            assert r["case"].startswith("decode") and r["measured_s"] == pytest.approx(0.011, rel=0.05)
            assert r["error"] < -0.4
    assert launch_bound(step_cases()) == {
        "decode B=1 C=1024",
        "decode B=1 C=4096",
        "decode B=1 C=16384",
        "decode B=32 C=1024",
    }
    # Decode reads KV at about half the peak HBM bandwidth, not the 80 % the datasheet model assumed.
    assert H200.decode_share == pytest.approx(0.515, abs=0.005)


def test_the_fit_recovers_known_constants_and_leave_one_out_reports_each_fitted_case() -> None:
    truth = dict(zip(STEP_CONSTANTS, (0.004, 2e-5, 1.5e-9, 3e-5, 5e-8), strict=True))
    prof = H200.with_(**truth)
    grid = [StepCase("p", "prefill", 1, n, c, 0.0) for n, c in ((512, 0), (4096, 0), (2048, 8192))]
    grid += [StepCase("d", "decode", b, 1, c, 0.0) for b in (64, 256) for c in (2048, 16384)]
    exact = [
        StepCase(f"{c.kind}{i}", c.kind, c.batch, c.new, c.context, c.predicted_s(prof))
        for i, c in enumerate(grid)
    ]
    assert fit_step(exact) == pytest.approx(truth, rel=1e-6)
    loo = leave_one_out(step_cases())
    assert set(loo) == {c.case for c in fitted_cases(step_cases())}
    assert max(abs(e) for e in loo.values()) < 0.25


def test_a_decode_case_is_launch_bound_only_near_the_one_sequence_time() -> None:
    cases = [StepCase(f"d{b}", "decode", b, 1, 1024, t) for b, t in ((1, 0.010), (8, 0.0109), (64, 0.0111))]
    assert launch_bound(cases) == {"d1", "d8"}
    assert LAUNCH_MARGIN == 0.10


def test_the_gpu_copy_constants_are_the_fit_to_the_measured_copies() -> None:
    fitted = fit_copies()
    for name, value in fitted.items():
        assert getattr(H200, name) == pytest.approx(value, rel=5e-3), name
    assert 54e9 < H200.d2h_bytes_per_s < 56e9 and 0.85 < H200.duplex_share < 0.95


def test_the_h200_copy_model_is_within_10_percent_of_every_measured_copy() -> None:
    from tokencake.sim.calibrate import copy_errors

    rows = copy_errors(H200)
    assert {(r["direction"], r["blocks"]) for r in rows} == {
        (d, n) for d in ("d2h", "h2d", "both") for n in (128, 1024, 2048)
    }
    assert all(abs(r["error"]) <= 0.10 for r in rows), rows
    alone = [r for r in rows if r["direction"] != "both"]
    assert all(abs(r["error"]) <= 0.02 for r in alone), alone
    # Both directions at once take longer than either alone: the shared link, not two links.
    both = {r["blocks"]: r for r in rows if r["direction"] == "both"}
    assert all(both[r["blocks"]]["predicted_s"] > r["predicted_s"] for r in alone)


def test_the_h100_is_the_h200_fit_scaled_by_hbm_bandwidth() -> None:
    scale = H200.hbm_bytes_per_s / H100.hbm_bytes_per_s
    assert H100.step_s == pytest.approx(H200.step_s * scale)
    assert H100.decode_s_per_ctx_token == pytest.approx(H200.decode_s_per_ctx_token * scale)
    assert H100.decode_share == pytest.approx(H200.decode_share)
    for name in ("prefill_s_per_token", "attn_s_per_token_ctx", "decode_s_per_seq", "copy_base_s"):
        assert getattr(H100, name) == getattr(H200, name)
    assert H100.d2h_bytes_per_s == H100.h2d_bytes_per_s == 50e9  # assumed, not measured


def test_the_step_cases_are_priced_as_the_engine_prices_a_step() -> None:
    from types import SimpleNamespace

    from tokencake.sim.engine import Engine

    for case in step_cases():
        generated = 1 if case.kind == "decode" else 0
        req = SimpleNamespace(
            generated=generated, num_computed=case.context, total_tokens=case.context + case.new
        )
        engine_s = Engine._step_time(SimpleNamespace(profile=H200), [(req, case.new)] * case.batch)
        assert case.predicted_s(H200) == pytest.approx(engine_s, rel=1e-12)


@pytest.mark.skipif(not (BENCH / "gpu-step.json").is_file(), reason="docs/bench has no gpu-step.json")
def test_the_packaged_measurements_are_the_compact_of_the_stored_files() -> None:
    data = measurements()
    assert data == compact_measurements(BENCH)
    assert data["device"] == "NVIDIA H200"
    # Each source names the commit that measured it (its file's provenance).
    assert set(data["commits"]) == set(data["sources"]) and all(data["commits"].values())


def test_the_report_states_each_case_and_which_were_fitted() -> None:
    from tokencake.sim.calibrate import report

    doc = report(H200)
    assert (
        doc["measured_on"]["device"] == "NVIDIA H200"
        and doc["measured_on"]["commits"] == measurements()["commits"]
    )
    assert doc["fitted_cases"] == 13 and doc["worst_fitted_error"] <= 0.10
    step = {r["case"]: r for r in doc["step"]}
    assert [r["case"] for r in doc["step"]] == [c.case for c in step_cases()]
    assert step["decode B=1 C=1024"]["leave_one_out"] is None
    assert (
        step["decode B=256 C=16384"]["fitted"] and step["decode B=256 C=16384"]["leave_one_out"] is not None
    )
    assert doc["decode_share"] == pytest.approx(H200.decode_share)
    assert set(doc["copy"]) >= {"d2h/128", "both/2048"} and doc["worst_copy_error"] <= 0.10
