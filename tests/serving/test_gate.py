from __future__ import annotations

import dataclasses

import pytest

from tokencake.serving.gate import REASONS, Decision, GateInput, OffloadGate, TransferModel

MB = 1_000_000
# 1 GB/s each way and no fixed cost: 10 blocks of 1 MB take 10 ms per direction.
TRANSFER = dict(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, base_s=0.0)


def make_gate(**kw: object) -> OffloadGate:
    return OffloadGate(TransferModel(**TRANSFER), **kw)  # type: ignore[arg-type]


BASE = GateInput(
    predicted_s=5.0,
    num_blocks=10,
    block_bytes=MB,
    device_usage=0.7,  # under pressure (>= 0.6) but no emergency (< 0.85)
    num_waiting=0,
    host_free_blocks=100,
)


def decide(gate: OffloadGate | None = None, **changes: object) -> Decision:
    return (gate or make_gate()).decide(dataclasses.replace(BASE, **changes))  # type: ignore[arg-type]


def test_offload_when_everything_holds() -> None:
    d = decide()
    assert (d.offload, d.reason) == (True, "offload")
    assert d.blocks_to_copy == 10
    assert d.est_d2h_s == pytest.approx(0.01)
    assert d.est_h2d_s == pytest.approx(0.01)
    assert d.margin_s == pytest.approx(0.05)  # max(50 ms, 2 x 20 ms)
    assert d.slack_s == pytest.approx(5.0 - 0.02 - 0.05)


def test_disabled() -> None:
    d = decide(make_gate(enabled=False))
    assert (d.offload, d.reason) == (False, "disabled")


def test_unknown_session() -> None:
    assert decide(session_known=False).reason == "unknown_session"


def test_no_blocks() -> None:
    d = decide(num_blocks=0)
    assert (d.offload, d.reason) == (False, "no_blocks")


def test_already_on_host_is_free_offload() -> None:
    d = decide(num_on_host=10, predicted_s=0.0, device_usage=0.0, host_free_blocks=0)
    assert (d.offload, d.reason, d.blocks_to_copy) == (True, "already_on_host", 0)


def test_partially_on_host_copies_only_new_blocks() -> None:
    d = decide(num_on_host=4)
    assert d.blocks_to_copy == 6
    assert d.est_d2h_s == pytest.approx(0.006)
    assert d.est_h2d_s == pytest.approx(0.010)  # the whole prefix comes back


def test_too_short_uses_margin_rule() -> None:
    # transfer 20 ms, margin 50 ms: needs 70 ms of stall.
    assert decide(predicted_s=0.069).reason == "too_short"
    assert decide(predicted_s=0.071).reason == "offload"
    # large transfers: margin = 2x transfer (200 blocks: 0.4 s transfer, 0.8 s margin).
    assert decide(num_blocks=200, host_free_blocks=200, predicted_s=1.1).reason == "too_short"
    assert decide(num_blocks=200, host_free_blocks=200, predicted_s=1.3).reason == "offload"


def test_elapsed_time_shrinks_window() -> None:
    assert decide(predicted_s=1.0, elapsed_s=0.95).reason == "too_short"
    assert decide(predicted_s=1.0, elapsed_s=0.5).reason == "offload"


def test_overdue_stall_estimates_remaining_from_elapsed() -> None:
    # Overdue by a little: 0.5 x 1.05 s left covers the round trip and the margin.
    d = decide(predicted_s=1.0, elapsed_s=1.05)
    assert d.reason == "offload" and d.remaining_s == pytest.approx(0.525)
    # Just begun and already overdue (a zero forecast): nothing left to win.
    assert decide(predicted_s=0.0, elapsed_s=0.01).reason == "too_short"
    # overdue_factor=0 restores "an overdue stall is never offloaded".
    assert decide(make_gate(overdue_factor=0.0), predicted_s=1.0, elapsed_s=1.5).reason == "too_short"


def test_emergency_drops_margin() -> None:
    # 40 ms stall cannot cover 20 ms transfer + 50 ms margin, but in an emergency the margin is 0.
    assert decide(predicted_s=0.04, device_usage=0.7).reason == "too_short"
    d = decide(predicted_s=0.04, device_usage=0.9)
    assert (d.reason, d.emergency, d.margin_s) == ("offload", True, 0.0)
    assert decide(predicted_s=0.04, device_usage=0.1, emergency=True).reason == "offload"
    assert decide(predicted_s=0.01, device_usage=0.9).reason == "too_short"


def test_no_pressure_and_queued_demand() -> None:
    d = decide(device_usage=0.3)
    assert (d.offload, d.reason, d.retryable) == (False, "no_pressure", True)
    assert decide(device_usage=0.3, num_waiting=2).reason == "offload"
    assert decide(device_usage=0.6).reason == "offload"
    # usage_threshold=0 offloads regardless of pressure; min_waiting=0 ignores the queue.
    assert decide(make_gate(usage_threshold=0.0), device_usage=0.0).reason == "offload"
    assert decide(make_gate(min_waiting=0), device_usage=0.3, num_waiting=5).reason == "no_pressure"


def test_host_pool_full_counts_reclaimable() -> None:
    d = decide(host_free_blocks=5)
    assert (d.offload, d.reason, d.retryable) == (False, "host_pool_full", True)
    assert decide(host_free_blocks=5, host_reclaimable_blocks=5).reason == "offload"
    # only the blocks not yet on host need room
    assert decide(host_free_blocks=5, num_on_host=5).reason == "offload"


def test_every_reason_reachable_and_counted() -> None:
    gate = make_gate()
    decide(gate)
    decide(gate, session_known=False)
    decide(gate, num_blocks=0)
    decide(gate, num_on_host=10)
    decide(gate, predicted_s=0.0)
    decide(gate, device_usage=0.0)
    decide(gate, host_free_blocks=0)
    off = make_gate(enabled=False)
    decide(off)
    counts = gate.counts()
    assert {r for r, n in counts.items() if n} == set(REASONS) - {"disabled"}
    assert off.counts()["disabled"] == 1
    assert gate.stats()["decisions"] == counts


def test_deterministic() -> None:
    gate = make_gate()
    assert decide(gate) == decide(gate)


def test_transfer_model_estimate_and_ewma() -> None:
    tm = TransferModel(d2h_bytes_per_s=1e9, h2d_bytes_per_s=2e9, base_s=0.001, alpha=0.5)
    assert tm.estimate("d2h", 0) == 0.0
    assert tm.estimate("d2h", 10 * MB) == pytest.approx(0.011)
    assert tm.estimate("h2d", 10 * MB) == pytest.approx(0.006)
    tm.observe("d2h", 100 * MB, 0.001 + 0.025)  # observed 4 GB/s
    assert tm.bandwidth("d2h") == pytest.approx(2.5e9)  # halfway from 1 to 4 GB/s
    assert tm.bandwidth("h2d") == 2e9
    tm.observe("d2h", 100, 1.0)  # tiny copy: ignored
    tm.observe("d2h", 100 * MB, 0.0)  # impossible time: ignored
    assert tm.bandwidth("d2h") == pytest.approx(2.5e9)
    assert tm.stats()["observed_d2h"] == 1
    with pytest.raises(ValueError, match="direction"):
        tm.estimate("up", 1)  # type: ignore[arg-type]


def test_transfer_model_device_defaults() -> None:
    assert TransferModel.for_device(True).bandwidth("d2h") == 12e9
    assert TransferModel.for_device(False).bandwidth("h2d") == TransferModel.CPU_BYTES_PER_S
    assert TransferModel.for_device(False, h2d_bytes_per_s=1.0).bandwidth("h2d") == 1.0


def test_learned_bandwidth_changes_decision() -> None:
    tm = TransferModel(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, base_s=0.0, alpha=1.0)
    gate = OffloadGate(tm)
    inp = dataclasses.replace(BASE, predicted_s=0.1)
    assert gate.decide(inp).reason == "offload"
    tm.observe("h2d", 10 * MB, 0.1)  # the host turned out slow: 100 MB/s
    assert gate.decide(inp).reason == "too_short"
