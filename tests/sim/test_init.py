"""``tokencake.sim``'s public names: the package's API, whichever module defines each."""

from __future__ import annotations

import tokencake.sim as sim

PUBLIC = [
    "PROFILES",
    "SYSTEMS",
    "AppTrace",
    "DelayStep",
    "HardwareProfile",
    "LLMStep",
    "NodeTrace",
    "SimResult",
    "ToolStep",
    "Trace",
    "TraceError",
    "get_profile",
    "simulate",
]


def test_the_public_names_are_pinned_and_importable() -> None:
    assert sim.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(sim, name) is not None, name
