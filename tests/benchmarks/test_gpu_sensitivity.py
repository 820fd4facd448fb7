"""``benchmarks/gpu_sensitivity.py``: each cell changes only its assumptions, and the run resumes."""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tokencake.sim.profiles import get_profile

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_sensitivity.py"
_spec = importlib.util.spec_from_file_location("gpu_sensitivity", _PATH)
gpu_sensitivity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_sensitivity)

H200 = get_profile("h200-llama3-8b")


def test_a_cell_changes_only_its_assumptions() -> None:
    same = gpu_sensitivity.cell_profile(H200, None, "measured", 1.0)
    assert {k: v for k, v in same.__dict__.items() if k != "name"} == {
        k: v for k, v in H200.__dict__.items() if k != "name"
    }
    slow = gpu_sensitivity.cell_profile(H200, 0.5, "perfect", 0.5)
    assert slow.decode_share == pytest.approx(0.5)
    assert (slow.duplex_share, slow.copy_compute_slowdown) == (1.0, 0.0)
    assert (
        slow.d2h_bytes_per_s == H200.d2h_bytes_per_s / 2 and slow.h2d_bytes_per_s == H200.h2d_bytes_per_s / 2
    )
    assert slow.step_s == H200.step_s and slow.prefill_s_per_token == H200.prefill_s_per_token
    assert "decode=0.5" in slow.name and "overlap=perfect" in slow.name and "pcie=x0.5" in slow.name


def test_the_grid_starts_with_the_calibrated_cell_and_each_assumption_alone() -> None:
    axes = gpu_sensitivity.cells("axes")
    full = gpu_sensitivity.cells("full")
    assert axes[0] == (None, "measured", 1.0) and len(axes) == 5
    assert full[:5] == axes and len(full) == len(set(full)) == 12


def test_rows_already_stored_are_kept_and_not_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fake_simulate(trace: object, prof: object, system: str) -> SimpleNamespace:
        calls.append(system)
        e2e = 2.0 if system == "ideal" else 3.0
        counts = {
            "device_hit_tokens": 0,
            "prompt_tokens": 1,
            "host_hit_tokens": 0,
            "computed_prompt_tokens": 1,
        }
        return SimpleNamespace(e2e_mean_s=e2e, extension={}, wall_s=0.0, **counts)

    monkeypatch.setattr(gpu_sensitivity, "simulate", fake_simulate)
    monkeypatch.setattr(gpu_sensitivity, "generate", lambda *a, **k: None)
    out = tmp_path / "s.json"
    monkeypatch.setattr(sys, "argv", ["x", "--agents", "4", "--grid", "axes", "--out", str(out)])
    assert gpu_sensitivity.main() == 0
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 5 and doc["rows"][0]["tokencake/ideal"] == 1.5
    assert calls.count("ideal") == 3  # once per decode share
    calls.clear()
    assert gpu_sensitivity.main() == 0
    assert calls == [] and len(json.loads(out.read_text())["rows"]) == 5
    # Another grid and a smaller point later: rows stay sorted by agents, then in the full grid's order.
    monkeypatch.setattr(sys, "argv", ["x", "--agents", "2", "--grid", "full", "--out", str(out)])
    assert gpu_sensitivity.main() == 0
    rows = json.loads(out.read_text())["rows"]
    order = gpu_sensitivity.cells("full")
    keys = [(r["agents"], order.index(tuple(r["cell"].values()))) for r in rows]
    assert len(rows) == 17 and keys == sorted(keys) and keys[0] == (2, 0) and keys[12] == (4, 0)
    ranges = json.loads(out.read_text())["ranges"]
    assert (
        ranges["4"]["on/off"] == {"min": 1.0, "max": 1.0, "cells": 5} and ranges["2"]["on/off"]["cells"] == 12
    )
