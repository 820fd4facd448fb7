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


def test_gpu_check_loads_the_copy_helpers_without_vllm_or_the_package() -> None:
    """Where ``tokencake`` cannot be imported (client dependencies missing) the script loads the copy
    modules from their files; none of them may need vLLM or a package ``__init__``."""
    code = (
        "import sys\n"
        "sys.modules['vllm'] = None  # not installed\n"
        "sys.modules['tokencake.agents'] = None  # the package __init__ cannot run\n"
        f"sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
        "import gpu_check, torch\n"
        "cp = gpu_check.load_copy_module()\n"
        "kv = gpu_check.load_tokencake_module('serving.vllm._kv_layout')\n"
        "caches = {'l0': torch.randn(8, 2, 4, 4)}\n"
        "copier = cp.BlockCopier(caches, 8, 4)\n"
        "before = caches['l0'][[2, 5]].clone()\n"
        "copier.copy('d2h', [2, 5], [0, 1])\n"
        "copier.copy('h2d', [6, 7], [0, 1])\n"
        "assert torch.equal(caches['l0'][[6, 7]], before)\n"
        "assert kv.find_block_dim((2, 8, 4), 8) == 1\n"
        "assert 'tokencake.serving.server' not in sys.modules  # no package __init__ ran\n"
        "print(cp.__name__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["tokencake.serving.vllm._copy"]


def test_results_record_what_ran_with_git_and_without(tmp_path, monkeypatch) -> None:
    """``provenance``: the commit and dirty flag from git; on a copy without ``.git`` (the device
    machine) the commit from ``TOKENCAKE_COMMIT``; the code hash changes with any tokencake file."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    here = gpu_check.provenance("gpu_step.py")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert here["commit"] == head.stdout.strip() and isinstance(here["dirty"], bool)
    copy = tmp_path / "copy"
    (copy / "scripts").mkdir(parents=True)
    (copy / "scripts" / "gpu_step.py").write_bytes((ROOT / "scripts" / "gpu_step.py").read_bytes())
    (copy / "tokencake").mkdir()
    (copy / "tokencake" / "a.py").write_text("X = 1\n")
    monkeypatch.setattr(gpu_check, "ROOT", copy)
    monkeypatch.setenv("TOKENCAKE_COMMIT", "abc123")
    bare = gpu_check.provenance("gpu_step.py")
    assert bare["commit"] == "abc123" and bare["dirty"] is None
    assert bare["script_sha256"] == here["script_sha256"]
    (copy / "tokencake" / "a.py").write_text("X = 2\n")
    assert gpu_check.provenance("gpu_step.py")["tokencake_py_sha256"] != bare["tokencake_py_sha256"]
