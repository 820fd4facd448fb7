"""Dependency direction (the brief's rule): only ``tokencake/serving/vllm/`` imports vLLM or torch.

The policy modules, the connector's options and the whole simulator must import cleanly without
them, so policies stay unit-testable and drivable by ``tokencake sim`` on a machine without vLLM.
"""

from __future__ import annotations

import subprocess
import sys

VLLM_FREE = (
    "tokencake.serving.forecast",
    "tokencake.serving.gate",
    "tokencake.serving.host_pool",
    "tokencake.serving.prefetch",
    "tokencake.serving.sessions",
    "tokencake.serving.stats",
    "tokencake.serving.event_api",
    "tokencake.serving.options",
    "tokencake.serving.policies",
    "tokencake.serving.profile",
    "tokencake.serving.kvcore",
    "tokencake.serving.kvcore.core",
    "tokencake.serving.kvcore.wire",
    "tokencake.serving.transparent",
    "tokencake.serving.transparent_asgi",
    "tokencake.serving.transparent_events",
    "tokencake.serving.transparent_http",
    "tokencake.serving.transparent_reply",
    "tokencake.sim",
    "tokencake.sim.validate",
    "tokencake.sim.stored",
    "tokencake.sim.calibrate",
    "tokencake.sim.presets",
    "tokencake.cli._sim",
)


def test_policy_modules_and_the_simulator_import_neither_torch_nor_vllm() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {VLLM_FREE!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = [m for m in ('torch', 'vllm') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
