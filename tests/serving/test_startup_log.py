"""Reading vLLM's log: the root cause of a failed start, its fix, and the one-line message."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokencake.serving.startup_log import startup_cause, startup_error_message, startup_hint


def test_startup_cause_is_the_engine_error_not_the_wrapper(kv_log: tuple[str, str]) -> None:
    log, cause = kv_log
    assert startup_cause(log) == cause[:400] + "…"
    msg = startup_error_message(1, log)
    assert "\n" not in msg
    assert msg.startswith(
        "vLLM exited with code 1 while starting: ValueError: To serve at least one request with the "
        "model's max seq len (4096)"
    )
    assert "raise RuntimeError(" not in msg and "Engine core initialization failed" not in msg
    assert "gpu_memory_utilization" not in msg  # vLLM's engine-argument advice is replaced by ours
    assert msg.endswith(
        "— fix: the KV cache cannot hold one request of --max-model-len: lower --max-model-len "
        "(about 2944 fits) or give more KV with --num-gpu-blocks / --kv-cache-gib"
    )


@pytest.mark.parametrize(
    ("log", "cause", "hint"),
    [
        (
            "INFO 12-01 10:00:00 [x.py:1] starting\nTraceback (most recent call last):\n"
            '  File "a.py", line 1, in <module>\n    raise ValueError(\n'
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`\n",
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
            "lower --max-model-len",
        ),
        (
            "(APIServer pid=1) ERROR 12-01 10:00:00 [api_server.py:9] OSError: [Errno 98] Address "
            "already in use\n",
            "OSError: [Errno 98] Address already in use",
            "pick another --port",
        ),
        (
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
            "  Value error, Invalid repository ID or local directory specified: '/nope'. "
            "[type=value_error, input_value=ArgsKwargs((), {}), input_type=ArgsKwargs]\n",
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: Value error, "
            "Invalid repository ID or local directory specified: '/nope'.",
            "",
        ),
        (
            "(EngineCore pid=3) ERROR 12-01 10:00:00 [core.py:9] worker died unexpectedly\n"
            "(APIServer pid=2) RuntimeError: Engine core initialization failed. See root cause above.\n",
            "worker died unexpectedly",
            "",
        ),
        ("just some output\n    raise RuntimeError(\n", "", ""),
    ],
)
def test_startup_cause_and_hint(log: str, cause: str, hint: str) -> None:
    assert startup_cause(log) == cause
    assert hint in startup_hint(cause)
    if not cause:
        assert startup_error_message(1, log, Path("/l.log")) == (
            "vLLM exited with code 1 while starting (log: /l.log)"
        )
