"""``benchmarks/release_plan.py``: fresh seeds, the plans' systems, the drawn workloads, the time estimate."""

import importlib
import json
import random
import sys
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_DIR))
try:
    plan = importlib.import_module("release_plan")
    unseen_real = importlib.import_module("unseen_real")
finally:
    sys.path.remove(str(_DIR))


def test_used_seeds_finds_seeds_in_results_names_and_text(tmp_path):
    bench = tmp_path / "docs" / "bench"
    bench.mkdir(parents=True)
    (bench / "a-results.json").write_text(
        json.dumps({"config": {"order_seed": 11}, "points": [{"workload": {"seed": 12, "apps": 99}}]})
    )
    (bench / "b.json").write_text(json.dumps({"seeds": [13, 14], "runs": {"draw_seed": "unseen-real:15"}}))
    (bench / "kv-integrity-seed16.json").write_text("{}")
    (tmp_path / "docs" / "notes.md").write_text("fresh seeds 17, 18 and 19; 20 apps\n")
    used = plan.used_seeds(tmp_path)
    assert set(range(11, 20)) <= used
    assert 0 in used  # the presets' seed
    assert 99 not in used  # a number under another key is not a seed


def test_fresh_draws_refuse_used_draw_seeds_and_used_workload_seeds():
    taken_workload = unseen_real.draw(random.Random("unseen-real:5"))["seed"]
    bits = iter([3, 5, 3, 7, 8, 9])
    draws = plan.fresh_draws(2, {3, taken_workload}, lambda _n: next(bits))
    assert [d["seed"] for d in draws] == [7, 8]  # 3 used, 5's workload seed used, 3 again
    assert all(d["knobs"] == unseen_real.draw(random.Random(f"unseen-real:{d['seed']}")) for d in draws)
    assert draws[0]["knobs"]["seed"] != draws[1]["knobs"]["seed"]


def test_every_plan_runs_tokencake_with_both_controls_everywhere():
    default, full = plan.plan_systems("default"), plan.plan_systems("full")
    assert default.cut and not full.cut
    for p in (default, full):
        for name, systems in p.systems.items():
            need = plan.NO_PRESSURE if name == "no-pressure" else plan.CONTROLS
            assert set(need) <= set(systems), (p.name, name)
    assert full.systems["draw-1"] == plan.ALL_SYSTEMS and len(plan.ALL_SYSTEMS) == 7
    assert default.systems["ci"] == plan.ALL_SYSTEMS and "baseline" in default.systems["headroom"]
    with pytest.raises(plan.ReleaseError, match="unknown plan"):
        plan.plan_systems("most")


def test_the_workloads_are_the_presets_both_stress_points_the_draws_and_no_pressure():
    draws = plan.fresh_draws(3, set(), random.Random(1).getrandbits)
    ws = plan.workloads(plan.plan_systems("default"), draws)
    assert [w.name for w in ws] == [
        "ci",
        "headroom",
        "stress-hetero",
        "stress-shared",
        "draw-1",
        "draw-2",
        "draw-3",
        "no-pressure",
    ]
    assert [w.kind for w in ws] == ["ci", "headroom", "stress", "stress", "draw", "draw", "draw", "ci"]
    drawn = ws[4]
    assert drawn.argv == tuple(unseen_real.bench_args(draws[0]["knobs"])) and drawn.draw == draws[0]
    config = plan.bench_config(drawn, 5)
    knobs = draws[0]["knobs"]
    assert [s.name for s in config.systems] == list(drawn.systems) and config.repeat == 5
    assert len(config.points) == 1 and config.points[0].workload.seed == knobs["seed"]
    assert config.server.device_blocks == knobs["device_blocks"] and config.shuffle_systems
    stress = plan.bench_config(ws[3], 5)
    assert [p.label for p in stress.points] == ["shared"]
    with pytest.raises(plan.ReleaseError, match="tool-s"):
        plan.bench_config(plan.Workload("x", "x", ("--preset", "ci", "--tool-s", "0"), ("tokencake",)), 5)


def test_unit_time_comes_from_the_units_done_else_the_stored_runs(tmp_path):
    for i, (boot, replay) in enumerate([(30, 60), (40, 70), (50, 80)]):
        systems = {
            "baseline": {"server_start_s": boot, "replay_s": replay},
            "tokencake": {"server_start_s": boot, "replay_s": replay / 2},
        }
        results = {"kind": "tokencake-bench", "preset": "ci", "wall_s": 2 * boot + 1.5 * replay}
        results["points"] = [{"systems": systems}]
        (tmp_path / f"r{i}-results.json").write_text(json.dumps(results))
    priors = plan.stored_priors(tmp_path)
    assert priors["system"]["ci:baseline"] == 110 and priors["system"]["ci:tokencake"] == 75
    assert priors["overhead"] == pytest.approx(1.0)
    w = plan.Workload(
        "ci", "ci", ("--preset", "ci"), ("baseline", "baseline-priority", "tokencake", "infercept")
    )
    nothing = {"done": {}}
    # baseline-priority is timed like baseline; infercept (no stored runs) like the kind's median
    kind = priors["kind"]["ci"]
    assert plan.unit_seconds(nothing, w, priors) == pytest.approx(110 + 110 + 75 + kind)
    assert plan.unit_seconds(nothing, w, None) == 0.0
    other = {"done": {"x#1": {"unit": "x#1", "wall_s": 300.0, "systems": 3}}}
    assert plan.unit_seconds(other, w, priors) == pytest.approx(4 * 100.0)  # per system-run of the units done
    own = {"done": {**other["done"], "ci#1": {"unit": "ci#1", "wall_s": 500.0, "systems": 4}}}
    assert plan.unit_seconds(own, w, priors) == 500.0
