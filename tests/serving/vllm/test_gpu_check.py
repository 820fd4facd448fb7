"""``scripts/gpu_check.sh`` and ``scripts/gpu_overlap.py`` must exit cleanly, with a message,
where there is no CUDA device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would measure")
@pytest.mark.parametrize(
    "command",
    [[str(ROOT / "scripts" / "gpu_check.sh")], [sys.executable, str(ROOT / "scripts" / "gpu_overlap.py")]],
    ids=["check", "overlap"],
)
def test_gpu_scripts_without_cuda_say_so_and_exit_0(command: list[str]) -> None:
    proc = subprocess.run(
        command,
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
