"""run_bench end to end against FakeServer/FakeVLLM (conftest): real SDK, real report, no vLLM."""

import csv
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tokencake.bench import RESULTS_SCHEMA, presets, report, terminal
from tokencake.bench.agent_mix import JOIN_SYSTEM
from tokencake.bench.runner import run_bench, served_provenance, system_order

# FakeServer's events URL refuses connections, so the SDK warns once per run (expected here).
pytestmark = pytest.mark.filterwarnings("ignore:stall events are not reaching")

TINY = dict(
    apps=3,
    turns=2,
    context_tokens=30,
    max_tokens=5,
    tool_s=(0.0, 0.02),
    device_blocks=40,
)


def _config(systems=None, **kw):
    return presets.build("ci", presets.Overrides(systems=systems, **{**TINY, **kw}))


def _run(fake_server, config, tmp_path):
    return run_bench(
        config,
        server_cls=fake_server,
        log_dir=tmp_path / "logs",
        transport=lambda: fake_server.instances[-1].backend.transport(),
    )


def _by_system(servers):
    """The fake servers by system name (from their log file ``<point>-<system>.log``)."""
    return {s.kwargs["log_file"].rsplit("/", 1)[1][len("ci-") : -len(".log")]: s for s in servers}


#: Extension counters the fake tokencake server adds per chat completion.
STATS = {"offload.bytes": 4096, "offload.blocks": 2, "prefetch.on_time": 3, "prefetch.late": 1}


def test_full_run_produces_valid_results_and_files(fake_server, fake_vllm, tmp_path):
    def backend(server):
        if server.kwargs["baseline"] and server.kwargs["num_gpu_blocks"] == 40:
            return fake_vllm(hit_fraction=0.0)
        if server.kwargs["baseline"]:
            return fake_vllm(hit_fraction=0.9)
        return fake_vllm(hit_fraction=0.6, stats=STATS)

    fake_server.make_backend = staticmethod(backend)
    config = _config(systems=["baseline", "tokencake", "ideal", "offload-only"])
    results = _run(fake_server, config, tmp_path)

    jsonschema.validate(results, RESULTS_SCHEMA)
    assert results["valid"] is True and results["warnings"] == []
    # One fresh server per system, each stopped; the same device KV except for the ideal.
    servers = _by_system(fake_server.instances)
    assert [s.entered and s.exited for s in servers.values()] == [True] * 4
    blocks = {name: s.kwargs["num_gpu_blocks"] for name, s in servers.items()}
    assert blocks == {"baseline": 40, "tokencake": 40, "ideal": blocks["ideal"], "prefetch-off": 40}
    assert blocks["ideal"] > 40
    tc_kwargs = servers["tokencake"].kwargs
    assert tc_kwargs["extension_config"] == {"offload": True, "prefetch": True, "demand_load": True}
    assert servers["prefetch-off"].kwargs["extension_config"]["prefetch"] is False
    assert servers["baseline"].kwargs["log_file"].endswith("ci-baseline.log")

    point = results["points"][0]
    assert point["equal_work"]["passed"] and point["equal_work"]["calls_compared"] == 3 * 2
    for name, s in point["systems"].items():
        assert s["client"]["apps"] == 3 and s["client"]["apps_failed"] == 0, name
        assert len(s["calls"]) == 6
        assert all(c["completion_tokens"] == 5 for c in s["calls"])  # forced max_tokens + ignore_eos
        assert s["kv"]["series"], "KV usage was sampled"
        assert s["server"]["requests"] == 6
    sent = servers["baseline"].backend.bodies
    assert all(b["ignore_eos"] is True and b["temperature"] == 0.0 for b in sent)
    # Each fresh server got one discarded warm-up request before the measured replay.
    assert [s.backend.warmups for s in servers.values()] == [1] * 4
    assert all(point["systems"][n]["warmup_s"] is not None for n in servers)

    base, tc_, ideal = (
        point["systems"][n]["server"]["computed_prompt_tokens"] for n in ("baseline", "tokencake", "ideal")
    )
    comp = point["comparison"]
    assert comp["recomputed_tokens_avoided"] == base - tc_ > 0
    assert comp["avoidable_recompute"]["fraction_avoided"] == pytest.approx((base - tc_) / (base - ideal))
    assert comp["prefetch_on_time_rate"] == pytest.approx(0.75)
    assert set(comp) >= {"tokencake/baseline", "tokencake/ideal", "baseline/ideal", "prefetch-off/baseline"}
    assert point["systems"]["baseline"]["extension"] is None
    assert point["systems"]["tokencake"]["extension"]["summary"]["offload_bytes"] == 6 * 4096

    written = report.write_all(results, tmp_path / "out")
    names = {p.name for p in written}
    assert names == {
        "results.json",
        "summary.csv",
        "summary.md",
        "calls.csv",
        "e2e_cdf.png",
        "kv_usage.png",
        "node_breakdown.png",
    }
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| app E2E mean (s) |" in md and "tokencake/baseline" in md and "Equal work: passed" in md
    for p in written:
        assert p.stat().st_size > 0, p
    assert (tmp_path / "out" / "e2e_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    jsonschema.validate(json.loads((tmp_path / "out" / "results.json").read_text()), RESULTS_SCHEMA)
    rows = list(csv.DictReader((tmp_path / "out" / "summary.csv").open()))
    assert [r["system"] for r in rows] == ["baseline", "tokencake", "ideal", "prefetch-off"]
    assert len(list(csv.DictReader((tmp_path / "out" / "calls.csv").open()))) == 4 * 6


def test_unequal_work_marks_results_invalid(fake_server, fake_vllm, tmp_path, capsys):
    fake_server.make_backend = staticmethod(
        lambda server: fake_vllm(short_by=0 if server.kwargs["baseline"] else 2)
    )
    results = _run(fake_server, _config(systems=["baseline", "tokencake"]), tmp_path)
    assert results["valid"] is False
    ew = results["points"][0]["equal_work"]
    assert not ew["passed"] and ew["output_token_mismatch_count"] == 6
    assert any("EQUAL-WORK CHECK FAILED" in w for w in results["warnings"])
    jsonschema.validate(results, RESULTS_SCHEMA)

    from rich.console import Console

    console = Console(width=160, force_terminal=False)
    terminal.render(results, console)
    out = capsys.readouterr().out
    assert "EQUAL-WORK CHECK FAILED" in out and "INVALID" in out


def test_failed_apps_are_reported_not_raised(fake_server, fake_vllm, tmp_path):
    def broken(arrival, latency):
        raise RuntimeError("cannot build")

    fake_server.make_backend = staticmethod(lambda server: fake_vllm())
    results = run_bench(
        _config(systems=["baseline"]),
        server_cls=fake_server,
        build_app=broken,
        transport=lambda: fake_server.instances[-1].backend.transport(),
    )
    s = results["points"][0]["systems"]["baseline"]
    assert s["client"]["apps_failed"] == 3
    assert s["apps"][0]["error"] == "RuntimeError: cannot build"
    assert results["valid"] is False


def test_open_loop_arrivals_start_on_schedule(fake_server, fake_vllm, tmp_path):
    fake_server.make_backend = staticmethod(lambda server: fake_vllm())
    config = _config(systems=["baseline"], rates=[20.0], arrival="uniform")
    results = _run(fake_server, config, tmp_path)
    point = results["points"][0]
    assert point["label"] == "ci@20/s"
    starts = [a["arrival_s"] for a in point["systems"]["baseline"]["apps"]]
    assert starts == pytest.approx([0.0, 0.05, 0.1], abs=1e-6)
    assert point["workload"]["rate"] == 20.0 and point["workload"]["arrival"] == "uniform"


def test_a_system_that_cannot_start_is_reported_and_the_others_kept(fake_server, fake_vllm, tmp_path):
    class Flaky(fake_server):
        def __enter__(self):
            if not self.kwargs["baseline"]:
                raise RuntimeError("vLLM exited during startup")
            return super().__enter__()

    Flaky.make_backend = staticmethod(lambda server: fake_vllm())
    results = run_bench(
        _config(systems=["baseline", "tokencake"]),
        server_cls=Flaky,
        log_dir=tmp_path,
        transport=lambda: Flaky.instances[-1].backend.transport(),
    )
    jsonschema.validate(results, RESULTS_SCHEMA)
    assert results["valid"] is False and results["failed_systems"] == ["ci:tokencake"]
    assert list(results["points"][0]["systems"]) == ["baseline"]
    assert any("vLLM exited during startup" in w and "ci-tokencake.log" in w for w in results["warnings"])


def test_interleaved_rounds_are_pooled(fake_server, fake_vllm, tmp_path, capsys):
    fake_server.make_backend = staticmethod(
        lambda server: fake_vllm(hit_fraction=0.0 if server.kwargs["baseline"] else 0.5)
    )
    config = presets.build("ci", presets.Overrides(systems=["baseline", "tokencake"], repeat=2, **TINY))
    results = _run(fake_server, config, tmp_path)
    jsonschema.validate(results, RESULTS_SCHEMA)
    # Interleaved: both systems run in round 1 before either runs in round 2, in the recorded order.
    ran = [not s.kwargs["baseline"] for s in fake_server.instances]
    orders = [o["order"] for o in results["system_orders"]]
    assert ran == [name == "tokencake" for order in orders for name in order]
    assert [sorted(o) for o in orders] == [["baseline", "tokencake"]] * 2
    assert [p["system_order"] for p in results["points"]] == orders
    assert [p["label"] for p in results["points"]] == ["ci#1", "ci#2"]
    agg = results["aggregate"]["ci"]
    assert agg["repeats"] == 2 and agg["systems"]["baseline"]["e2e_s"]["count"] == 6
    per_round = agg["tokencake/baseline_mean_per_round"]
    assert len(per_round) == 2 and all(r is not None for r in per_round)
    pooled = [a["e2e_s"] for p in results["points"] for a in p["systems"]["tokencake"]["apps"]]
    assert agg["systems"]["tokencake"]["e2e_s"]["mean"] == pytest.approx(sum(pooled) / len(pooled))
    assert agg["comparison"]["recomputed_tokens_avoided"] > 0

    from rich.console import Console

    terminal.render(results, Console(width=160))
    assert "2 interleaved rounds pooled" in capsys.readouterr().out


def test_system_order_puts_each_system_in_each_position_equally_often():
    names = ["baseline", "tokencake", "ideal", "prefetch-off", "demand-off"]
    config = presets.build("ci", presets.Overrides(systems=names, repeat=10, seed=3, **TINY))
    orders = [[s.name for s in system_order(config, rep, "ci")] for rep in range(10)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert orders == [[s.name for s in system_order(config, rep, "ci")] for rep in range(10)]
    for position in range(len(names)):
        assert Counter(o[position] for o in orders) == dict.fromkeys(names, 2)
    other = presets.build("ci", presets.Overrides(systems=names, repeat=10, seed=4, **TINY))
    assert orders != [[s.name for s in system_order(other, rep, "ci")] for rep in range(10)]
    fixed = presets.build("ci", presets.Overrides(systems=names, fixed_order=True, **TINY))
    assert all([s.name for s in system_order(fixed, rep, "ci")] == names for rep in range(8))


def test_results_record_what_each_server_was_started_with(fake_server, fake_vllm, tmp_path):
    fake_server.make_backend = staticmethod(lambda server: fake_vllm())
    config = presets.build("ci", presets.Overrides(systems=["baseline", "tokencake"], **TINY))
    results = _run(fake_server, config, tmp_path)
    systems = results["points"][0]["systems"]
    assert systems["baseline"]["served"]["scheduling_policy"] == "fcfs"
    assert systems["baseline"]["served"]["scheduler_cls"] is None
    served = systems["tokencake"]["served"]
    assert served["scheduling_policy"] == "priority" and served["dtype"] == "float32"
    assert served["scheduler_cls"] == systems["tokencake"]["system"]["scheduler"]
    assert served["num_gpu_blocks"] == str(systems["tokencake"]["num_gpu_blocks"])
    assert served["host_pool_blocks"] == config.server.host_pool_blocks > 0
    assert systems["baseline"]["served"]["host_pool_blocks"] is None
    assert isinstance(results["machine"]["cpu_flags"], list)


def test_served_provenance_is_empty_when_the_server_cannot_say():
    assert served_provenance(object()) == {}


def test_runs_of_single_rounds_pool_into_the_run_of_all_rounds(fake_server, fake_vllm, tmp_path):
    fake_server.make_backend = staticmethod(lambda server: fake_vllm())
    names = ["baseline", "tokencake", "ideal"]
    config = presets.build("ci", presets.Overrides(systems=names, repeat=3, seed=2, **TINY))
    whole = [[s.name for s in system_order(config, rep, "ci")] for rep in range(3)]
    parts = [_run_rounds(fake_server, config, tmp_path, [rep]) for rep in (2, 0, 1)]
    assert [p["rounds_run"] for p in parts] == [[3], [1], [2]]
    assert [p["points"][0]["label"] for p in parts] == ["ci#3", "ci#1", "ci#2"]
    assert [p["system_orders"][0]["order"] for p in parts] == [whole[2], whole[0], whole[1]]
    assert all(p["aggregate"] is None for p in parts)  # one round: nothing to pool
    assert _run_rounds(fake_server, config, tmp_path, [0, 2])["rounds_run"] == [1, 3]
    with pytest.raises(ValueError, match=r"rounds must be among 0\.\.2"):
        _run_rounds(fake_server, config, tmp_path, [3])


def _run_rounds(fake_server, config, tmp_path, rounds):
    return run_bench(
        config,
        server_cls=fake_server,
        log_dir=tmp_path / "logs",
        transport=lambda: fake_server.instances[-1].backend.transport(),
        rounds=rounds,
    )


def test_two_systems_alternate_first_over_rounds():
    config = presets.build("ci", presets.Overrides(systems=["baseline", "tokencake"], repeat=5, **TINY))
    firsts = Counter(system_order(config, rep, "ci")[0].name for rep in range(5))
    assert sorted(firsts.values()) == [2, 3]


def test_results_follow_the_configured_order_whatever_the_run_order(fake_server, fake_vllm, tmp_path):
    fake_server.make_backend = staticmethod(lambda server: fake_vllm())
    names = ["baseline", "tokencake", "ideal"]
    config = presets.build("ci", presets.Overrides(systems=names, repeat=3, seed=1, **TINY))
    results = _run(fake_server, config, tmp_path)
    started = _started_systems(fake_server.instances)
    assert started == [n for o in results["system_orders"] for n in o["order"]]
    assert [o["round"] for o in results["system_orders"]] == [1, 2, 3]
    assert all(list(p["systems"]) == names for p in results["points"])
    assert results["config"]["shuffle_systems"] is True and results["config"]["order_seed"] == 1


def _started_systems(servers):
    """System names in the order their servers were created (log file ``<label>-<system>.log``)."""
    return [s.kwargs["log_file"].rsplit("/", 1)[1].split("-", 1)[1][: -len(".log")] for s in servers]


def test_stress_preset_replays_both_points_on_fake_servers(fake_server, fake_vllm, tmp_path):
    fake_server.make_backend = staticmethod(
        lambda server: fake_vllm(hit_fraction=0.0 if server.kwargs["baseline"] else 0.5, stats={})
    )
    o = presets.Overrides(
        systems=["baseline", "tokencake"],
        apps=2,
        workers=2,
        turns=2,
        context_tokens=30,
        max_tokens=5,
        tool_s=(0.01, 0.01),
        rates=[50.0],
        latency="scaled:0.01",
        repeat=1,
    )
    results = _run(fake_server, presets.build("stress", o), tmp_path)
    jsonschema.validate(results, RESULTS_SCHEMA)
    assert results["valid"] is True, results["warnings"]
    assert [p["label"] for p in results["points"]] == ["hetero@50/s", "shared@50/s"]
    for point in results["points"]:
        assert point["equal_work"]["calls_compared"] == 2 * (2 * 2 + 1)  # 2 apps x (2 workers x 2 + join)
        apps = point["systems"]["baseline"]["apps"]
        assert all(set(a["nodes"]) == {"worker_0", "worker_1", "join"} for a in apps)
        assert "agent_mix" in point["workload"]["notes"][0]
    logs = {Path(s.kwargs["log_file"]).name: s for s in fake_server.instances}
    assert set(logs) == {f"{p}@50_s-{n}.log" for p in ("hetero", "shared") for n in ("baseline", "tokencake")}

    def worker_systems(log):
        systems = {b["messages"][0]["content"] for b in logs[log].backend.bodies}
        assert JOIN_SYSTEM in systems
        return systems - {JOIN_SYSTEM}

    # Only the shared point's workers (2 apps x 2) open with the common preamble.
    assert len(worker_systems("shared@50_s-baseline.log")) == 4
    assert all(p.startswith("Team handbook.") for p in worker_systems("shared@50_s-baseline.log"))
    assert not any(p.startswith("Team handbook.") for p in worker_systems("hetero@50_s-baseline.log"))


def test_memory_per_system_counts_device_and_host_kv():
    from tokencake.bench.runner import BenchConfig, _fill_block_bytes, memory_of
    from tokencake.bench.systems import ServerConfig, resolve_systems

    base, tc_ = resolve_systems(["baseline", "tokencake"])
    config = BenchConfig(preset="x", points=[], systems=[base, tc_], server=ServerConfig(device_blocks=40))
    ext = {
        "after": {"engine": {"device_blocks": 40, "block_bytes": 1000}, "config": {"host_pool_blocks": 100}}
    }
    per = {
        "baseline": {"memory": memory_of(base, config, {"extension": None})},
        "tokencake": {"memory": memory_of(tc_, config, {"extension": ext})},
    }
    assert per["tokencake"]["memory"]["total_bytes"] == 140_000
    assert per["baseline"]["memory"]["device_bytes"] is None  # stock vLLM does not report its block size
    _fill_block_bytes(per)
    assert per["baseline"]["memory"] == {
        "device_blocks": 40,
        "host_blocks": 0,
        "block_bytes": 1000,
        "device_bytes": 40_000,
        "host_bytes": 0,
        "total_bytes": 40_000,
    }


def test_replicas_systems_merge_every_replicas_metrics_and_stats(fake_server, fake_vllm, tmp_path):
    """Two replicas behind a (fake) router: what the bench reports is both replicas' work."""
    fake_server.make_backend = staticmethod(lambda server: fake_vllm(hit_fraction=0.5, stats=STATS))
    started: list[Any] = []

    class FakeReplicas:
        def __init__(self, n, *, router_policy, log_dir, **kwargs):
            self.policy, self.log_dir, self.kwargs = router_policy, log_dir, kwargs
            self.servers = [
                fake_server(**{**kwargs, "log_file": f"{log_dir}/replica-{i}.log"}) for i in range(n)
            ]
            for i, s in enumerate(self.servers):
                s.base_url, s.events_url = f"http://replica{i}/v1", f"http://127.0.0.{i + 2}:9"
            self.base_url, self.model = "http://router/v1", "fake"
            self.turn = 0
            started.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def handler(self, request: httpx.Request) -> httpx.Response:
            host = request.url.host
            if host == "router":  # round robin
                self.turn += 1
                return self.servers[self.turn % 2].backend.handler(request)
            index = int(host[-1]) if host.startswith("replica") else int(host.rsplit(".", 1)[1]) - 2
            return self.servers[index].backend.handler(request)

    config = _config(systems=["replicas-affinity", "replicas-round-robin"])
    results = run_bench(
        config,
        server_cls=fake_server,
        replicas_cls=FakeReplicas,
        log_dir=tmp_path / "logs",
        transport=lambda: httpx.MockTransport(started[-1].handler),
    )
    jsonschema.validate(results, RESULTS_SCHEMA)
    assert results["valid"], results["warnings"]
    by_policy = {r.policy: r for r in started}
    assert set(by_policy) == {"consistent_hash", "round_robin"}
    affinity = by_policy["consistent_hash"]
    assert affinity.kwargs["num_gpu_blocks"] == 40 and affinity.log_dir.name == "ci-replicas-affinity"
    point = results["points"][0]
    for name, policy in (("replicas-affinity", "consistent_hash"), ("replicas-round-robin", "round_robin")):
        r = by_policy[policy]
        s = point["systems"][name]
        served = [len(x.backend.bodies) for x in r.servers]
        assert sum(served) == 6 and min(served) > 0, served
        assert s["server"]["requests"] == 6  # both replicas' counters
        assert s["extension"]["summary"]["offloaded_blocks"] == 6 * STATS["offload.blocks"]
        assert s["kv"]["mean"] == pytest.approx(0.5)  # the mean of the replicas' usage, not the sum
        assert s["num_gpu_blocks"] == 80 and s["system"]["replicas"] == 2
        # No events listener through a router: the SDK marks requests for derived stalls.
        metas = [b["kv_transfer_params"]["tokencake"] for x in r.servers for b in x.backend.bodies]
        assert all(m.get("stall_events") is False for m in metas)
