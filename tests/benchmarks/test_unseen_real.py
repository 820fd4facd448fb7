"""``benchmarks/unseen_real.py``: its draws stay in their ranges and are valid bench command lines."""

import importlib.util
import json
import random
from pathlib import Path

import pytest

from tokencake.cli import main

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "unseen_real.py"
_spec = importlib.util.spec_from_file_location("unseen_real", _PATH)
unseen_real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unseen_real)


def test_draws_are_seeded_and_bounded_in_prompt_work():
    first = [unseen_real.draw(random.Random(f"unseen-real:{s}")) for s in range(40)]
    again = [unseen_real.draw(random.Random(f"unseen-real:{s}")) for s in range(40)]
    assert first == again
    lo, hi = unseen_real.WORK_RANGE
    for knobs in first:
        assert lo <= unseen_real.work(knobs) / unseen_real.STRESS_WORK <= hi
        assert 32 <= knobs["device_blocks"] <= 64 and knobs["point"] in ("hetero", "shared")
    # the draw is not one regime: both points, both arrival processes, spread-out contexts
    assert {k["point"] for k in first} == {"hetero", "shared"}
    assert {k["arrival"] for k in first} == {"poisson", "uniform"}
    assert max(k["context_tokens"] for k in first) > 2 * min(k["context_tokens"] for k in first)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_drawn_command_is_a_valid_bench_run_of_that_workload(seed, capsys, tmp_path):
    knobs = unseen_real.draw(random.Random(f"unseen-real:{seed}"))
    cmd = unseen_real.command(knobs, systems="baseline,tokencake,ideal", repeat=3, out=tmp_path)
    assert cmd[1:3] == ["-m", "tokencake"]
    assert main([*cmd[3:], "--dry-run"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in data["config"]["systems"]] == ["baseline", "tokencake", "ideal"]
    assert data["config"]["server"]["device_blocks"] == knobs["device_blocks"]
    assert data["config"]["repeat"] == 3
    (wl,) = data["workloads"]
    assert wl["seed"] == knobs["seed"] and wl["arrival"] == knobs["arrival"]
    assert len(wl["arrivals"]) == knobs["apps"]
    params = wl["arrivals"][0]["params"]
    assert params["workers"] == knobs["workers"] and params["turns"] == [knobs["turns"]] * 2
    assert params["max_tokens"] == knobs["max_tokens"] and params["tool_median_s"] == knobs["tool_s"]
    assert (params["shared_prefix_tokens"] > 0) == (knobs["point"] == "shared")
