"""The model against the stored real runs: within ±15 % and the same ranking (issue 11)."""

from __future__ import annotations

from tokencake.sim.validate import FIXTURES, TOLERANCE, ranking_violations, validate


def test_predicted_mean_e2e_is_within_tolerance_of_the_real_runs_and_ranks_the_same() -> None:
    rows = validate()
    assert {r.preset for r in rows} == set(FIXTURES)
    assert {r.system for r in rows if r.preset == "stress"} >= {"baseline", "tokencake", "ideal", "continuum"}
    worst = max(rows, key=lambda r: abs(r.error))
    assert abs(worst.error) <= TOLERANCE, worst
    assert ranking_violations(rows) == []
