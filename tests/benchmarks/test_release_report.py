"""``benchmarks/release_report.py`` and ``release_table.py``: captured against the reference never above
100 %, intervals that span both, targets judged, the full and brief table blocks rewritten
idempotently with valid claims markers."""

import importlib
import itertools
import json
import re
import sys
from pathlib import Path

import pytest

from tokencake.bench.claims import claims, render
from tokencake.bench.metrics import summarize

_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_DIR))
try:
    report = importlib.import_module("release_report")
    tables = importlib.import_module("release_table")
finally:
    sys.path.remove(str(_DIR))

EXT = {
    "readiness_eligible": 10,
    "readiness_prefetched": 6,
    "readiness_not_needed": 1,
    "readiness_loading": 1,
    "next_turn_prefix_tokens": 1000,
    "next_turn_prefix_tokens_recomputed": 50,
}


def unit(rep, e2e, *, apps=4, label="ci"):
    """One finished unit (one round) as run_bench writes it: ``e2e`` is each system's base E2E."""
    systems = {}
    for name, base in e2e.items():
        times = [base * (1 + 0.1 * i) * (1 + 0.03 * (rep % 2)) for i in range(apps)]
        stock = name.startswith(("baseline", "ideal"))
        systems[name] = {
            "apps": [{"run_id": f"a{i}", "status": "ok", "e2e_s": t} for i, t in enumerate(times)],
            "client": {"e2e_s": summarize(times)},
            "server": {"computed_prompt_tokens": 100.0 * base, "preemptions": 0, "prompt_tokens": 9000},
            "extension": None if stock else {"summary": dict(EXT)},
            "served": {"dtype": "float32", "scheduling_policy": "fcfs" if name == "baseline" else "priority"},
            "memory": {"device_blocks": 40, "host_blocks": 0 if stock else 200},
        }
    point = {"label": f"{label}#{rep}", "base_label": label, "repeat": rep, "system_order": list(e2e)}
    return {
        "versions": {"git_commit": "c0ffee1234", "git_dirty": False, "vllm": "0.32.0", "torch": "2.9"},
        "machine": {
            "cpu_model": "Test CPU",
            "cpu_flags": ["avx2"],
            "loadavg_start": [1.0],
            "loadavg_end": [1.1],
        },
        "started": f"2026-01-0{rep}T00:00:00+00:00",
        "wall_s": 100.0,
        "points": [{**point, "systems": systems}],
    }


SYSTEMS = ("baseline", "baseline-priority", "tokencake", "tokencake-roomy", "offload-all")


def workload(name="ci", systems=SYSTEMS, role="pressure", draw=None):
    argv = ["--preset", "ci"]
    return {"name": name, "title": name, "argv": argv, "systems": list(systems), "draw": draw, "role": role}


def test_captured_against_the_reference_never_exceeds_100_percent():
    grid = [0.5, 0.9, 0.99, 1.0, 1.01, 1.05, 1.2, 2.0, 5.0]
    for s, t in itertools.product(grid, grid):
        c = report.captured_against_reference(s, t)
        if s <= 1.0:
            assert c is None  # stock+priority lost nothing: nothing to capture
        else:
            assert c <= 1.0
            assert c == (1.0 if t <= 1.0 else pytest.approx((s - t) / (s - 1)))
    # TokenCake faster than the reference every round: 100 %, flagged, the interval clipped too.
    ratios = {
        report.TC_REF: {"reported": {"ratio": 0.9}},
        report.PRIO_REF: {"reported": {"ratio": 1.3}},
    }
    series = {
        report.TC_REF: {"per_round": [0.85, 0.95, 1.02]},
        report.PRIO_REF: {"per_round": [1.3, 1.2, 1.4]},
    }
    cap = report.captured(ratios, series)
    assert cap["value"] == 1.0 and cap["tokencake_faster_than_reference"]
    assert cap["per_round"][:2] == [1.0, 1.0] and cap["per_round"][2] == pytest.approx(1 - 0.02 / 0.4)
    assert cap["reported"]["ci95"][1] == 1.0 and cap["reported"]["ci95"][0] < 1.0


def test_the_reported_interval_spans_the_app_and_round_intervals():
    got = report.reported({"ratio": 1.0, "ci95": [0.95, 1.03]}, {"mean": 1.01, "ci95": [0.97, 1.08]})
    assert got["ratio"] == 1.0 and got["ci95"] == [0.95, 1.08] and "and" in got["interval"]
    assert report.reported({"ratio": 1.0, "ci95": None}, None)["ci95"] is None


def test_targets_are_judged_on_the_reported_interval():
    at_most = report.TARGETS[0]  # TokenCake / reference <= 1.10
    assert at_most.status(1.05, [1.00, 1.08]) == "met"
    assert at_most.status(1.05, [1.00, 1.12]) == "not established"
    assert at_most.status(1.12, [1.05, 1.20]) == "not met"
    assert at_most.status(1.15, [1.11, 1.20]) == "missed"
    assert at_most.status(None, None) == "not measured"
    at_least = report.TARGETS[1]  # captured >= 85 %
    assert at_least.status(0.9, [0.86, 1.0]) == "met" and at_least.status(0.8, [0.7, 0.84]) == "missed"


def _manifest(tmp_path, rounds=3):
    """A set of three workloads with fake finished units under ``tmp_path / 'set'``."""
    out = tmp_path / "set"
    plan = {"name": "default", "cut": ["policies not run on the draws"], "not_in_set": {"paper": "long"}}
    manifest = {
        "identity": {"commit": "c0ffee1234", "tokencake_tree": "t1"},
        "plan": {**plan, "rounds": rounds},
        "seeds": {"draws": [123456789]},
        "reference": "tokencake-roomy",
        "units": [],
        "done": {},
        "attempts": [],
        "workloads": [
            workload(),
            workload("draw-1", SYSTEMS[1:4], draw={"seed": 123456789, "knobs": {}}),
            workload("no-pressure", ("ideal-priority", "tokencake-roomy"), role="no-pressure"),
        ],
    }
    e2e = {
        "ci": dict(zip(SYSTEMS, (20.0, 18.0, 16.0, 15.0, 17.0), strict=True)),
        "draw-1": {"baseline-priority": 18.0, "tokencake": 19.5, "tokencake-roomy": 15.0},
        "no-pressure": {"ideal-priority": 15.0, "tokencake-roomy": 15.2},
    }
    for w in manifest["workloads"]:
        for rep in range(1, rounds + 1):
            key = f"{w['name']}#{rep}"
            manifest["units"].append({"unit": key})
            path = Path("units") / w["name"] / f"round-{rep}.json"
            (out / path).parent.mkdir(parents=True, exist_ok=True)
            (out / path).write_text(json.dumps(unit(rep, e2e[w["name"]], label=w["name"])))
            manifest["done"][key] = {"unit": key, "file": str(path)}
    return manifest, out


def test_a_workload_summary_has_the_ratios_captured_shares_and_provenance(tmp_path):
    manifest, out = _manifest(tmp_path)
    index, summaries = report.summarize(manifest, out, {"tokencake_tree": "t1", "commit": "d00d"})
    ci = summaries[0]
    assert ci["rounds"] == {"planned": 3, "done": 3, "which": [1, 2, 3]}
    assert ci["ratios"][report.TC_REF]["reported"]["ratio"] == pytest.approx(16 / 15)
    assert ci["ratios"][report.TC_PRIO]["reported"]["ratio"] == pytest.approx(16 / 18)
    assert ci["captured"]["value"] == pytest.approx((18 / 15 - 16 / 15) / (18 / 15 - 1))
    assert ci["readiness"]["pooled"] == pytest.approx(0.8) and ci["recomputed"]["pooled"] == pytest.approx(
        0.05
    )
    prov = ci["provenance"]
    assert prov["commits"] == ["c0ffee1234"] and prov["dirty"] is False
    assert prov["versions"]["vllm"] == "0.32.0" and prov["machine"]["cpu_flags"] == ["avx2"]
    assert prov["served"]["baseline"]["scheduling_policy"] == "fcfs"
    assert prov["memory"]["tokencake"] == {"device_blocks": 40, "host_blocks": 200}
    assert ci["orders"] == [list(SYSTEMS)] * 3
    assert ci["per_round"]["tokencake"]["apps_e2e_s"][0]["a0"] == pytest.approx(16.0 * 1.03)
    draw = summaries[1]
    assert draw["targets"]["TokenCake / reference ≤ 1.10"]["status"] == "missed"
    assert "TokenCake / stock FCFS ≤ 0.50 (the product's target)" not in draw["targets"]  # not run there
    assert index["serving_code_is_head"] is True and index["units"]["done"] == 9


def test_the_table_block_is_rewritten_idempotently_with_valid_claims_markers(tmp_path):
    manifest, out = _manifest(tmp_path)
    results = tmp_path / "bench"
    doc = tmp_path / "README.md"
    doc.write_text(f"# Title\n\n{tables.OPEN}\nanything\n{tables.CLOSE}\n\nrest\n")
    head = {"tokencake_tree": "t1", "commit": "d00d"}
    done = tables.write_all(manifest, out, docs=[doc], strict=True, results_dir=results, head=head)
    assert done[-1] == f"updated {doc}"
    text = doc.read_text()
    assert text.startswith("# Title\n\n") and text.endswith("\n\nrest\n") and "anything" not in text
    quoted = claims(text)
    assert len(quoted) > 20 and all(f.startswith("release/") for f, *_ in quoted)
    assert render(text, results) == text  # what claims --check does
    shown = re.sub(r"<!--/?bench[^>]*-->", "", text)  # as Markdown renders it
    assert "| ci | 3 | 1.067 [" in shown and "| TokenCake / | offload-all | continuum | infercept |" in shown
    assert "| draw-1 | 3 | 1.300 [" in shown and "| — | — | — |" not in shown  # no policy ran there
    assert "TokenCake / reference ≤ 1.10: missed on draw-1 1.300 [" in shown
    assert "Cut from the full set (time): policies not run on the draws." in shown
    assert "fresh draws" in shown.lower() and "draw-1 seed 123456789" in shown
    again = tables.write_all(manifest, out, docs=[doc], strict=True, results_dir=results, head=head)
    assert again[-1] == f"unchanged {doc}" and doc.read_text() == text
    sizes = sum(p.stat().st_size for p in (results / report.SUBDIR).iterdir())
    assert sizes < 100_000


def test_a_brief_block_gets_the_main_columns_and_unmet_targets_without_numbers(tmp_path):
    manifest, out = _manifest(tmp_path, rounds=2)
    manifest["plan"]["rounds"] = 3  # one round of each workload left
    results = tmp_path / "bench"
    brief, full = tmp_path / "README.md", tmp_path / "benchmarks.md"
    brief.write_text(f"{tables.OPEN_BRIEF}\nold\n{tables.CLOSE}\n")
    full.write_text(f"{tables.OPEN}\nold\n{tables.CLOSE}\n")
    head = {"tokencake_tree": "t2", "commit": "d00d"}
    tables.write_all(manifest, out, docs=[brief, full], strict=True, results_dir=results, head=head)
    text = brief.read_text()
    assert text.startswith(tables.OPEN_BRIEF + "\n") and text.endswith(tables.CLOSE + "\n")
    assert render(text, results) == text and all(f.startswith("release/") for f, *_ in claims(text))
    shown = re.sub(r"<!--/?bench[^>]*-->", "", text)
    assert "| ci | 1.067 [" in shown and "| draw-1 | 1.300 [" in shown and "offload-all" not in shown
    assert "No-pressure cost, reference / stock+priority with the same KV: 1.013 [" in shown
    assert "- TokenCake / reference ≤ 1.10: missed on draw-1." in shown  # the status, not the number
    assert "Not finished: ci (2/3), draw-1 (2/3), no-pressure (2/3) rounds done." in shown
    assert "not HEAD's" in shown and "123456789" not in shown and "Cut from" not in shown
    assert tables.block_style(full.read_text()) == "full" and tables.block_style(text) == "brief"
    assert len(text) < len(full.read_text())


def test_a_file_without_the_markers_is_skipped_or_refused(tmp_path):
    manifest, out = _manifest(tmp_path, rounds=2)
    plain = tmp_path / "plain.md"
    plain.write_text("no table here\n")
    kw = {"results_dir": tmp_path / "bench", "head": {"tokencake_tree": "other", "commit": "x"}}
    done = tables.write_all(manifest, out, docs=[plain], **kw)
    assert done[-1].startswith(f"skipped {plain}") and plain.read_text() == "no table here\n"
    with pytest.raises(ValueError, match="exactly one"):
        tables.write_all(manifest, out, docs=[plain], strict=True, **kw)
    with pytest.raises(ValueError, match="exactly one"):
        tables.fill(f"{tables.OPEN}\n{tables.CLOSE}\n{tables.OPEN_BRIEF}\n{tables.CLOSE}\n", "x")
    index, summaries = report.summarize(manifest, out, kw["head"])
    lines = tables.not_met(index, summaries)
    assert any("not HEAD's" in line for line in lines)


def test_a_full_set_stays_small(tmp_path):
    """7 systems x 5 rounds x 8 workloads of 12 apps: the summaries stay far below 500 KB."""
    systems = (*SYSTEMS, "continuum", "infercept")
    e2e = dict(zip(systems, (20.0, 18.0, 16.0, 15.0, 17.0, 17.5, 17.2), strict=True))
    total = 0
    for i in range(8):
        units = [unit(rep, e2e, apps=12, label=f"w{i}") for rep in range(1, 6)]
        total += len(
            json.dumps(report.workload_summary(workload(f"w{i}", systems), units, 5, "tokencake-roomy"))
        )
    assert total < 500_000
