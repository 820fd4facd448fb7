from __future__ import annotations

import pytest

from tokencake.serving.policies import POLICY_NAMES, StockPolicy, make_policy


def test_every_name_builds_its_policy() -> None:
    for name in POLICY_NAMES:
        assert make_policy(name).name == name


def test_unknown_name_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match="unknown KV policy 'lru'; choose from tokencake, offload-all"):
        make_policy("lru")


def test_stock_decides_nothing(make_view) -> None:
    p = StockPolicy()
    assert p.on_finished(make_view()).action == "none"
    assert p.on_stall(make_view()).action == "none"
    assert not p.uses_events and not p.demand_load


def test_random_is_seeded(make_view) -> None:
    a, b = make_policy("random", seed=3), make_policy("random", seed=3)
    plans_a = [a.on_stall(make_view()) for _ in range(20)]
    assert plans_a == [b.on_stall(make_view()) for _ in range(20)]
    assert len({p.action for p in plans_a}) > 1
