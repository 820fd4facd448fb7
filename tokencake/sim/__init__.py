"""``tokencake sim``: replay agent traces on a model of vLLM's engine at any scale, driving the
connector's own KV core (no vLLM import). See ``docs/simulation.md``."""

from tokencake.sim.profiles import PROFILES, HardwareProfile, get_profile
from tokencake.sim.run import SYSTEMS, SimResult, simulate
from tokencake.sim.trace import AppTrace, DelayStep, LLMStep, NodeTrace, ToolStep, Trace, TraceError

__all__ = [
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
