"""The terminal report: system orders per round and per-round intervals."""

from rich.console import Console

from tokencake.bench.terminal import render


def test_terminal_shows_orders_and_intervals(pooled_results, capsys):
    render(pooled_results, Console(width=200, force_terminal=False))
    out = capsys.readouterr().out
    assert "system order per round: #1 ideal>baseline>tokencake>tokencake-roomy" in out
    assert "#3 tokencake>ideal>tokencake-roomy>baseline" in out
    assert "E2E mean tokencake/ideal: 1.067, 1.200, 1.133 → 1.133 [0.968, 1.299]" in out
    assert "ready rate: 0.50, 0.50, 0.50 → 0.50 [0.50, 0.50]" in out
    assert "tokencake: next-turn recomputed share 20% · ready rate 50%" in out
