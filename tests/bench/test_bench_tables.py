"""The cells and rows the terminal and Markdown reports share."""

from tokencake.bench.tables import interval_cells, round_rows


def test_one_round_has_no_interval():
    cells = interval_cells({"per_round": [0.9], "mean": 0.9, "ci95": None}, ".2f")
    assert cells == ("0.90", "0.90", "— (needs 2 rounds)")


def test_round_rows_list_headlines_then_each_systems_own_series():
    rounds = {"x:e2e_mean_s": {}, "tokencake/ideal": {}, "x:unknown": {}, "y:prefix_hit_rate": {}}
    rows = [(key, label) for key, (label, _spec) in round_rows(rounds)]
    assert rows == [
        ("tokencake/ideal", "E2E mean tokencake/ideal"),
        ("x:e2e_mean_s", "x: app E2E mean (s)"),
        ("y:prefix_hit_rate", "y: prefix hit rate"),
    ]
