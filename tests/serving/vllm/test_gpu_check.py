"""``scripts/gpu_check.sh`` must exit cleanly, with a message, where there is no CUDA device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would measure")
def test_gpu_check_without_cuda_says_so_and_exits_0() -> None:
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout


def test_gpu_check_loads_the_copy_helpers_without_vllm() -> None:
    """The script falls back to loading ``_copy.py`` by path: it must not need vLLM or tokencake."""
    src = (ROOT / "tokencake" / "serving" / "vllm" / "_copy.py").read_text()
    imports = [line for line in src.splitlines() if line.startswith(("import ", "from "))]
    assert all("vllm" not in line and "tokencake" not in line for line in imports), imports
