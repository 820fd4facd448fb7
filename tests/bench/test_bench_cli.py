import json

import pytest

from tokencake.bench import presets
from tokencake.bench.systems import ServerConfig, resolve_systems, server_kwargs
from tokencake.cli import main


def test_dry_run_prints_config_and_seeded_workload(capsys):
    assert (
        main(["bench", "--preset", "ci", "--dry-run", "--seed", "3", "--systems", "baseline,tokencake"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in data["config"]["systems"]] == ["baseline", "tokencake"]
    wl = data["workloads"][0]
    assert wl["seed"] == 3 and wl["llm"]["ignore_eos"] is True and wl["llm"]["temperature"] == 0.0
    assert wl["arrival"] == "concurrent" and len(wl["arrivals"]) == 6
    assert "synthetic" in wl["notes"][0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--systems", "baseline,fast"], "unknown system"),
        (["--rates", "0.1,x"], "--rates"),
        (["--tool-s", "1,2,3"], "--tool-s"),
        (["--latency", "quick"], "latency"),
        (["--mix", "multi_turn=1,chess=2"], "unknown app"),
        (["--mix", "multi_turn=x"], "weight"),
        (["--repeat", "0"], "--repeat"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert main(["bench", "--dry-run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokencake: error:") and message in err


def test_presets_are_well_formed():
    ci = presets.build("ci")
    assert ci.server.device_blocks == 40 and ci.server.ideal_blocks >= 2 * ci.server.device_blocks
    # room for every agent's final context (~1,000 tokens + turns) at once: 5 x 12 blocks
    assert ci.server.ideal_blocks >= 6 * 12
    assert [s.name for s in ci.systems] == ["baseline", "tokencake", "ideal"]
    head = presets.build("headroom")
    assert head.points[0].workload.arrivals[0].params["turns"] == 6
    paper = presets.build("paper", presets.Overrides(rates=[0.05, 1.0], apps=4))
    assert [p.label for p in paper.points] == ["0.05/s", "1/s"]
    assert paper.points[0].workload.arrival == "poisson"
    wl = paper.points[0].workload
    assert set(wl.mix) == {"code-writer", "deep-research"} and wl.latency == "paper"
    assert all(a.inputs.get("task") for a in wl.arrivals)


def test_server_kwargs_refuse_flags_the_launcher_cannot_express():
    class Bare:
        def __init__(self, model=None, *, baseline=False, num_gpu_blocks=None, host_pool_blocks=None):
            pass

    config = ServerConfig(device_blocks=40, ideal_blocks=300, host_pool_blocks=64)
    base, tc_, ideal, pf = resolve_systems(["baseline", "spatial-off", "ideal", "prefetch-off"])
    assert server_kwargs(base, config, Bare)["num_gpu_blocks"] == 40
    assert "host_pool_blocks" not in server_kwargs(base, config, Bare)
    assert server_kwargs(ideal, config, Bare)["num_gpu_blocks"] == 300
    assert server_kwargs(tc_, config, Bare)["host_pool_blocks"] == 64  # all flags on: the default
    with pytest.raises(ValueError, match="prefetch"):
        server_kwargs(pf, config, Bare)

    class Direct(Bare):
        def __init__(self, *a, offload=True, prefetch=True, demand_load=True, **kw):
            pass

    assert server_kwargs(pf, config, Direct)["prefetch"] is False


def test_the_hold_ablation_passes_its_connector_key_to_the_server():
    from tokencake.serving import Server

    (spec,) = resolve_systems(["hold-off"])
    kw = server_kwargs(spec, ServerConfig(), Server)
    assert kw["connector_config"] == {"hold_prefetched": False} and kw["policy"] == "tokencake"
    assert Server(**kw).connector_extra_config()["hold_prefetched"] is False
    assert spec.to_dict()["connector"] == {"hold_prefetched": False}

    class NoConfig:
        def __init__(self, model=None, *, baseline=False, num_gpu_blocks=None, policy=None):
            pass

    with pytest.raises(ValueError, match="connector"):
        server_kwargs(spec, ServerConfig(), NoConfig)


def test_tokencake_loads_the_spatial_scheduler_and_spatial_off_does_not():
    from tokencake.serving import Server
    from tokencake.serving.server import SPATIAL_SCHEDULER

    (spec,) = resolve_systems(["tokencake"])
    kw = server_kwargs(spec, ServerConfig(), Server)
    assert kw["scheduler_cls"] == SPATIAL_SCHEDULER and kw["policy"] == "tokencake"
    assert spec.to_dict()["scheduler"] == SPATIAL_SCHEDULER
    # The no-pressure cost system is what ``tokencake`` serves, with the ideal's KV.
    roomy = server_kwargs(resolve_systems(["tokencake-roomy"])[0], ServerConfig(), Server)
    assert roomy["scheduler_cls"] == SPATIAL_SCHEDULER and roomy["policy"] == "tokencake"
    # The ablation and the other policies pass None: vLLM's own scheduler, not Server's default.
    for name in ("spatial-off", "offload-all", "infercept"):
        off = server_kwargs(resolve_systems([name])[0], ServerConfig(), Server)
        assert "scheduler_cls" in off and off["scheduler_cls"] is None, name

    # The spatial ablations: the same scheduler, one connector key each.
    for name, key, value in (
        ("spatial-order", "critical_last", False),
        ("reserve-off", "critical_reserve_frac", 0.0),
        ("spare-late", "critical_spare_late", True),
        ("reserve-arrival", "critical_reserve_wait_from", "arrival"),
    ):
        ablation = resolve_systems([name])[0]
        kw = server_kwargs(ablation, ServerConfig(), Server)
        assert kw["scheduler_cls"] == SPATIAL_SCHEDULER, name
        assert ablation.options == {key: value} and ablation.to_dict()["connector"] == {key: value}

    class NoScheduler:
        def __init__(self, model=None, *, baseline=False, num_gpu_blocks=None, policy=None):
            pass

    with pytest.raises(ValueError, match="scheduler"):
        server_kwargs(spec, ServerConfig(), NoScheduler)


def test_priority_controls_are_stock_vllm_with_the_priority_scheduler():
    config = ServerConfig(device_blocks=40, ideal_blocks=300, extra_args=("--seed", "1"))
    base, bp_, ip = resolve_systems(["baseline", "baseline-priority", "ideal-priority"])
    assert "extra_args" not in server_kwargs(base, ServerConfig(), object)
    kw = server_kwargs(bp_, config, object)
    assert kw["baseline"] is True and kw["num_gpu_blocks"] == 40
    assert kw["extra_args"] == ("--seed", "1", "--scheduling-policy", "priority")
    kw = server_kwargs(ip, config, object)
    assert kw["num_gpu_blocks"] == 300 and kw["extra_args"][-2:] == ("--scheduling-policy", "priority")
    assert ip.to_dict()["priority"] is True and base.to_dict()["priority"] is False


def test_report_mode_rerenders_stored_results(tmp_path, capsys):
    results = {
        "schema_version": 1,
        "kind": "tokencake-bench",
        "preset": "ci",
        "wall_s": 1.0,
        "valid": True,
        "warnings": [],
        "points": [
            {
                "label": "ci",
                "systems": {},
                "equal_work": {"passed": True, "calls_compared": 0},
                "comparison": {"tokencake/baseline": {"mean": 0.5, "p95": 0.6}},
            }
        ],
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert main(["bench", "--report", str(tmp_path), "--no-plots"]) == 0
    assert "tokencake/baseline: mean 0.500" in capsys.readouterr().out
    assert main(["bench", "--report", str(tmp_path / "missing.json")]) == 2


def test_mix_override_adds_catalog_apps(capsys):
    argv = ["bench", "--dry-run", "--mix", "multi_turn=3,deep-research=1", "--apps", "8", "--seed", "1"]
    assert main(argv) == 0
    wl = json.loads(capsys.readouterr().out)["workloads"][0]
    apps = [a["app"] for a in wl["arrivals"]]
    assert set(apps) <= {"multi_turn", "deep-research"} and len(apps) == 8
    research = [a for a in wl["arrivals"] if a["app"] == "deep-research"]
    assert all(a["inputs"]["task"] for a in research)


def test_preset_choices_match_the_presets(capsys):
    from tokencake.cli._bench import PRESET_NAMES

    assert tuple(presets.PRESETS) == PRESET_NAMES
    with pytest.raises(SystemExit):
        main(["bench", "--preset", "nope", "--dry-run"])
    assert "invalid choice" in capsys.readouterr().err


def test_help_names_every_system(capsys):
    from tokencake.bench.systems import SYSTEMS

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    # argparse wraps the help text, also after a hyphen ("tokencake-\n roomy")
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    missing = [name for name in SYSTEMS if name not in text]
    assert not missing, missing


def test_stress_dry_run_has_two_points_and_takes_its_overrides(capsys):
    argv = ["bench", "--preset", "stress", "--dry-run", "--apps", "1", "--workers", "2", "--fixed-order"]
    assert main([*argv, "--tool-s", "2", "--systems", "baseline,tokencake-roomy"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["points"] == ["hetero", "shared"]
    assert data["config"]["shuffle_systems"] is False
    assert [s["name"] for s in data["config"]["systems"]] == ["baseline", "tokencake-roomy"]
    roomy = data["config"]["systems"][1]
    assert roomy["kv"] == "ideal" and not roomy["stock"] and all(roomy["flags"].values())
    hetero, shared = data["workloads"]
    assert len(hetero["arrivals"]) == len(shared["arrivals"]) == 1
    params = [w["arrivals"][0]["params"] for w in (hetero, shared)]
    assert [p["workers"] for p in params] == [2, 2] and params[0]["tool_median_s"] == 2.0
    assert params[0]["shared_prefix_tokens"] == 0 < params[1]["shared_prefix_tokens"]
    assert main(["bench", "--preset", "stress", "--dry-run", "--workers", "0"]) == 2
    assert "workers" in capsys.readouterr().err


def test_policy_systems_start_the_extension_with_their_policy():
    from tokencake.serving import Server

    config = ServerConfig(device_blocks=40, ideal_blocks=300)
    specs = resolve_systems(["offload-all", "continuum", "infercept", "stock-connector", "tokencake"])
    got = [server_kwargs(s, config, Server)["policy"] for s in specs]
    assert got == ["offload-all", "continuum", "infercept", "stock", "tokencake"]
    assert all(not s.stock and s.kv == "device" for s in specs)
    assert resolve_systems(["continuum"])[0].to_dict()["policy"] == "continuum"

    class NoPolicy:
        def __init__(self, model=None, *, baseline=False, num_gpu_blocks=None):
            pass

    with pytest.raises(ValueError, match="needs policy 'continuum'"):
        server_kwargs(specs[1], config, NoPolicy)
