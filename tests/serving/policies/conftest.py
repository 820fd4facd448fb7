"""A PolicyView builder for the policy tests: one session, sensible defaults, override anything."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from tokencake.serving.gate import GateInput
from tokencake.serving.policies import PolicyView

GATE = GateInput(
    predicted_s=5.0,
    num_blocks=10,
    block_bytes=1_000_000,
    device_usage=0.7,
    num_waiting=0,
    host_free_blocks=100,
)


def view(gate: dict[str, Any] | None = None, **fields: Any) -> PolicyView:
    base = PolicyView(
        gate=dataclasses.replace(GATE, **(gate or {})),
        session_id="run:A",
        agent_type="A",
        tool="search",
        device_blocks=100,
        device_free_blocks=20,
        recompute_s=1.0,
        d2h_s=0.01,
        h2d_s=0.01,
        announced=True,
    )
    return dataclasses.replace(base, **fields)


@pytest.fixture
def make_view() -> Callable[..., PolicyView]:
    return view
