from __future__ import annotations

from tokencake.serving.policies import OffloadAllPolicy


def test_stores_every_finished_request_without_events(make_view) -> None:
    p = OffloadAllPolicy()
    assert not p.uses_events
    plan = p.on_finished(make_view(announced=False, gate={"device_usage": 0.0}))
    assert (plan.action, plan.prefetch, plan.evict_first) == ("offload", "none", False)


def test_ignores_stalls(make_view) -> None:
    assert OffloadAllPolicy().on_stall(make_view()).action == "none"


def test_nothing_to_copy_or_no_room(make_view) -> None:
    p = OffloadAllPolicy()
    assert p.on_finished(make_view(gate={"num_on_host": 10})).reason == "already_on_host"
    assert p.on_finished(make_view(gate={"num_blocks": 0})).reason == "no_blocks"
    full = make_view(gate={"host_free_blocks": 3, "host_reclaimable_blocks": 2})
    assert p.on_finished(full).reason == "host_pool_full"
    # LRU-reclaimable slots count as room (an LRU host tier overwrites its oldest entries).
    assert (
        p.on_finished(make_view(gate={"host_free_blocks": 0, "host_reclaimable_blocks": 10})).action
        == "offload"
    )
