"""Shared fixtures of the serving tests: a CPU-only machine, and a real vLLM start-up failure log."""

from __future__ import annotations

import pytest

from tokencake.serving import machine


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only machine with native bf16 (no dtype override)."""
    monkeypatch.setattr(machine, "cuda_available", lambda: False)
    monkeypatch.setattr(machine, "vllm_installed", lambda: True)
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda cpuinfo=None: True)


# vLLM 0.32 log of `tokencake serve --num-gpu-blocks 24` (messages from vllm/v1/core/kv_cache_utils.py
# and vllm/v1/engine/utils.py; layout from vllm/logging_utils/formatter.py: continuation lines of a
# multi-line record are joined with "\r\n" + the prefix).
_E = "(EngineCore pid=4242) ERROR 12-01 10:00:03 [core.py:1510] "
KV_CAUSE = (
    "ValueError: To serve at least one request with the model's max seq len (4096), (0.09 GiB KV cache is "
    "needed, which is larger than the available KV cache memory (0.05 GiB). Based on the available memory, "
    "the estimated maximum model length is 2944. Try increasing `gpu_memory_utilization` (which also "
    "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. "
    "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)
KV_LOG = (
    "(APIServer pid=4200) INFO 12-01 10:00:00 [utils.py:286] non-default args: {'model': '/m'}\n"
    "(EngineCore pid=4242) INFO 12-01 10:00:02 [kv_cache_utils.py:2619] Overriding num_gpu_blocks=910 "
    "with num_gpu_blocks_override=24\n"
    + _E
    + "EngineCore failed to start.\r\n"
    + _E
    + "Traceback (most recent call last):\r\n"
    + _E
    + '  File "/v/vllm/v1/engine/core.py", line 1490, in run_engine_core\r\n'
    + _E
    + "    engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)\r\n"
    + _E
    + '  File "/v/vllm/v1/core/kv_cache_utils.py", line 1029, in _check_enough_kv_cache_memory\r\n'
    + _E
    + "    raise ValueError(\r\n"
    + _E
    + KV_CAUSE
    + "\n"
    "Process EngineCore:\n"
    "Traceback (most recent call last):\n"
    '  File "/usr/lib/python3.11/multiprocessing/process.py", line 314, in _bootstrap\n'
    "    self.run()\n"
    '  File "/v/vllm/v1/core/kv_cache_utils.py", line 1029, in _check_enough_kv_cache_memory\n'
    "    raise ValueError(\n" + KV_CAUSE + "\n"
    "(APIServer pid=4200) Traceback (most recent call last):\n"
    '(APIServer pid=4200)   File "<frozen runpy>", line 198, in _run_module_as_main\n'
    '(APIServer pid=4200)   File "/v/vllm/v1/engine/utils.py", line 1432, in wait_for_engine_startup\n'
    "(APIServer pid=4200)     raise RuntimeError(\n"
    "(APIServer pid=4200) RuntimeError: Engine core initialization failed. See root cause above. "
    "Failed core proc(s): {'EngineCore': 1}\n"
    "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: There appear to be 1 "
    "leaked shared_memory objects to clean up at shutdown\n"
    "  warnings.warn('resource_tracker: There appear to be %d '\n"
)


@pytest.fixture
def kv_log() -> tuple[str, str]:
    """``(log, cause)``: vLLM's log of a start that failed for lack of KV cache, and its root cause."""
    return KV_LOG, KV_CAUSE
