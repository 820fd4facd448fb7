"""The bench's in-process vLLM stand-ins (``tests/bench/conftest.py``) for the benchmark scripts' tests."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "bench_fakes", Path(__file__).parents[1] / "bench" / "conftest.py"
)
_fakes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fakes)

fake_server = _fakes.fake_server
fake_vllm = _fakes.fake_vllm
