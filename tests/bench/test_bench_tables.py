"""The cells and rows the terminal and Markdown reports share."""

from tokencake.bench.tables import interval_cells, round_rows, table_pairs


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


def test_each_revision_is_compared_with_its_running_code_system():
    names = ["tokencake@HEAD@{1}", "baseline", "tokencake", "spatial-off@v1", "ideal"]
    assert table_pairs(names) == [
        ("tokencake", "baseline"),
        ("tokencake", "ideal"),
        ("tokencake", "tokencake@HEAD@{1}"),
    ]
    rounds = {"tokencake/tokencake@HEAD@{1}": {}, "tokencake@HEAD@{1}:e2e_mean_s": {}}
    assert [label for _key, (label, _spec) in round_rows(rounds)] == [
        "E2E mean tokencake/tokencake@HEAD@{1} (running code / revision HEAD@{1})",
        "tokencake@HEAD@{1}: app E2E mean (s)",
    ]
