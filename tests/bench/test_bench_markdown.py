"""The Markdown report: per-round tables with intervals, per-point headlines."""

from tokencake.bench.markdown import markdown


def test_markdown_has_a_per_round_table_with_intervals(pooled_results):
    md = markdown(pooled_results)
    assert "## p: 3 rounds" in md and "| headline | per round | mean | 95 % CI |" in md
    # tokencake/baseline per round 0.800, 0.900, 0.850; mean 0.850 +- 4.303 * 0.05 / sqrt(3) = 0.124
    assert "| E2E mean tokencake/baseline | 0.800, 0.900, 0.850 | 0.850 | [0.726, 0.974] |" in md
    assert "| captured fraction (baseline - tokencake) / (baseline - ideal) | 0.80, 0.40, 0.60 | 0.60 |" in md
    assert "next-turn recomputed share | 0.20, 0.30, 0.40 | 0.30 | [0.05, 0.55] |" in md
    # Per point: the captured fraction and the roomy system's cost against the 1.02 target.
    assert "Captured fraction of the ideal's gain" in md
    assert "tokencake-roomy/ideal (extension cost without pressure): mean 1.020 (within the 1.02" in md
    assert "mean 1.040 (ABOVE the 1.02 target)" in md
