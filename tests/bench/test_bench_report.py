"""The report's per-point headlines and its per-round confidence intervals (terminal and Markdown)."""

import pytest
from rich.console import Console

from tokencake.bench import report
from tokencake.bench.runner import aggregate


@pytest.fixture
def results(make_round):
    ext = [{"next_turn_recomputed_share": s, "ready_rate": 0.5} for s in (0.2, 0.3, 0.4)]
    points = [
        make_round(i + 1, baseline=20.0, tokencake=(tc_, ext[i]), ideal=15.0, tokencake_roomy=15.3 + 0.3 * i)
        for i, tc_ in enumerate((16.0, 18.0, 17.0))
    ]
    for p in points:
        p["equal_work"] = {"passed": True, "calls_compared": 4}
    return {
        "preset": "stress",
        "valid": True,
        "wall_s": 1.0,
        "warnings": [],
        "points": points,
        "system_orders": [
            {"round": i + 1, "point": "p", "order": o}
            for i, o in enumerate(
                [["ideal", "baseline", "tokencake", "tokencake-roomy"]] * 2
                + [["tokencake", "ideal", "tokencake-roomy", "baseline"]]
            )
        ],
        "aggregate": aggregate(points),
    }


def test_markdown_has_a_per_round_table_with_intervals(results):
    md = report.markdown(results)
    assert "## p: 3 rounds" in md and "| headline | per round | mean | 95 % CI |" in md
    # tokencake/baseline per round 0.800, 0.900, 0.850; mean 0.850 +- 4.303 * 0.05 / sqrt(3) = 0.124
    assert "| E2E mean tokencake/baseline | 0.800, 0.900, 0.850 | 0.850 | [0.726, 0.974] |" in md
    assert "| captured fraction (baseline - tokencake) / (baseline - ideal) | 0.80, 0.40, 0.60 | 0.60 |" in md
    assert "next-turn recomputed share | 0.20, 0.30, 0.40 | 0.30 | [0.05, 0.55] |" in md
    # Per point: the captured fraction and the roomy system's cost against the 1.02 target.
    assert "Captured fraction of the ideal's gain" in md
    assert "tokencake-roomy/ideal (extension cost without pressure): mean 1.020 (within the 1.02" in md
    assert "mean 1.040 (ABOVE the 1.02 target)" in md


def test_terminal_shows_orders_and_intervals(results, capsys):
    report.render(results, Console(width=200, force_terminal=False))
    out = capsys.readouterr().out
    assert "system order per round: #1 ideal>baseline>tokencake>tokencake-roomy" in out
    assert "#3 tokencake>ideal>tokencake-roomy>baseline" in out
    assert "E2E mean tokencake/ideal: 1.067, 1.200, 1.133 → 1.133 [0.968, 1.299]" in out
    assert "ready rate: 0.50, 0.50, 0.50 → 0.50 [0.50, 0.50]" in out
    assert "tokencake: next-turn recomputed share 20% · ready rate 50%" in out


def test_one_round_has_no_interval():
    cells = report.interval_cells({"per_round": [0.9], "mean": 0.9, "ci95": None}, ".2f")
    assert cells == ("0.90", "0.90", "— (needs 2 rounds)")


def test_round_rows_list_headlines_then_each_systems_own_series():
    from tokencake.bench.report import round_rows

    rounds = {"x:e2e_mean_s": {}, "tokencake/ideal": {}, "x:unknown": {}, "y:prefix_hit_rate": {}}
    rows = [(key, label) for key, (label, _spec) in round_rows(rounds)]
    assert rows == [
        ("tokencake/ideal", "E2E mean tokencake/ideal"),
        ("x:e2e_mean_s", "x: app E2E mean (s)"),
        ("y:prefix_hit_rate", "y: prefix hit rate"),
    ]
