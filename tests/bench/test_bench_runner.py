"""run_bench end to end against FakeServer/FakeVLLM (conftest): real SDK, real report, no vLLM."""

import csv
import json

import jsonschema
import pytest

from tokencake.bench import RESULTS_SCHEMA, presets, report
from tokencake.bench.runner import run_bench

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
    servers = fake_server.instances
    assert [s.entered and s.exited for s in servers] == [True] * 4
    blocks = [s.kwargs["num_gpu_blocks"] for s in servers]
    assert blocks[0] == blocks[1] == blocks[3] == 40 and blocks[2] > 40
    assert servers[1].kwargs["extension_config"] == {"offload": True, "prefetch": True, "demand_load": True}
    assert servers[3].kwargs["extension_config"]["prefetch"] is False
    assert servers[0].kwargs["log_file"].endswith("ci-baseline.log")

    point = results["points"][0]
    assert point["equal_work"]["passed"] and point["equal_work"]["calls_compared"] == 3 * 2
    for name, s in point["systems"].items():
        assert s["client"]["apps"] == 3 and s["client"]["apps_failed"] == 0, name
        assert len(s["calls"]) == 6
        assert all(c["completion_tokens"] == 5 for c in s["calls"])  # forced max_tokens + ignore_eos
        assert s["kv"]["series"], "KV usage was sampled"
        assert s["server"]["requests"] == 6
    sent = servers[0].backend.bodies
    assert all(b["ignore_eos"] is True and b["temperature"] == 0.0 for b in sent)

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
    report.render(results, console)
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
    # Interleaved: baseline, tokencake, baseline, tokencake.
    assert [s.kwargs["baseline"] for s in fake_server.instances] == [True, False, True, False]
    assert [p["label"] for p in results["points"]] == ["ci#1", "ci#2"]
    agg = results["aggregate"]["ci"]
    assert agg["repeats"] == 2 and agg["systems"]["baseline"]["e2e_s"]["count"] == 6
    per_round = agg["tokencake/baseline_mean_per_round"]
    assert len(per_round) == 2 and all(r is not None for r in per_round)
    pooled = [a["e2e_s"] for p in results["points"] for a in p["systems"]["tokencake"]["apps"]]
    assert agg["systems"]["tokencake"]["e2e_s"]["mean"] == pytest.approx(sum(pooled) / len(pooled))
    assert agg["comparison"]["recomputed_tokens_avoided"] > 0

    from rich.console import Console

    report.render(results, Console(width=160))
    assert "2 interleaved rounds pooled" in capsys.readouterr().out
