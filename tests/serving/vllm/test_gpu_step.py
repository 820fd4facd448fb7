"""``scripts/gpu_step.py``: its whole code path on tiny shapes (``--smoke``, on the CPU here), its
predictions against ``Engine._step_time``, its attention against a plain reference, and the clean
exit without CUDA."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu_step.py"


@pytest.fixture(scope="module")
def gpu_step() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_step_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def run_smoke(gpu_step: ModuleType, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "step.json"
    assert gpu_step.main(["--smoke", "--repeats", "2", "--warmup", "1", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_smoke_times_and_predicts_every_case(gpu_step: ModuleType, tmp_path: Path) -> None:
    data = run_smoke(gpu_step, tmp_path)
    assert data["profile"] == "h200-llama3-8b" and data["smoke"] is True
    assert "launch overhead" in data["notes"]
    assert [r["case"] for r in data["rows"]] == [c.name for c in gpu_step.cases(smoke=True)]
    kinds = {(r["kind"], r["context"] > 0) for r in data["rows"]}
    assert kinds == {("prefill", False), ("prefill", True), ("decode", True)}
    for r in data["rows"]:
        assert r["skipped"] is False
        assert 0 < r["min_s"] <= r["measured_s"]
        assert r["predicted_s"] > 0
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0
        assert r["ratio"] == pytest.approx(r["measured_s"] / r["predicted_s"])
        assert r["attn"] in ("gqa", "repeat_kv", "math")


def test_cases_over_the_kv_bound_are_recorded_as_skipped(gpu_step: ModuleType, tmp_path: Path) -> None:
    data = run_smoke(gpu_step, tmp_path, "--max-kv-gib", "1e-4")
    skipped = [r["case"] for r in data["rows"] if r["skipped"]]
    assert skipped == ["decode B=4 C=64"]
    row = next(r for r in data["rows"] if r["skipped"])
    assert "measured_s" not in row and row["predicted_s"] > 0


def test_predictions_follow_the_engine_step_time(gpu_step: ModuleType) -> None:
    """Same constants as the package's profiles, same context convention as ``_step_time``."""
    from tokencake.sim.engine import Engine
    from tokencake.sim.profiles import PROFILES

    loaded = gpu_step.load_profiles().PROFILES
    for name, profile in PROFILES.items():
        assert loaded[name].__dict__ == profile.__dict__
    profile = PROFILES["h200-llama3-8b"]
    for case in gpu_step.cases(smoke=False):
        generated = 1 if case.kind == "decode" else 0
        req = SimpleNamespace(
            generated=generated, num_computed=case.context, total_tokens=case.context + case.new
        )
        engine_s = Engine._step_time(SimpleNamespace(profile=profile), [(req, case.new)] * case.batch)
        assert gpu_step.predicted(profile, case)["total_s"] == pytest.approx(engine_s, rel=1e-12)


@pytest.mark.parametrize("mode", ["gqa", "repeat_kv"])
@pytest.mark.parametrize(("new", "context"), [(5, 0), (5, 7), (1, 7)], ids=["causal", "chunk", "decode"])
def test_attention_matches_a_plain_reference(gpu_step: ModuleType, mode: str, new: int, context: int) -> None:
    shape = gpu_step.SMOKE
    model = gpu_step.Model(torch, shape, "cpu", torch.float32)
    model.attn_mode = mode
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, shape.heads, new, shape.head_dim, generator=g)
    k = torch.randn(2, shape.kv_heads, context + new, shape.head_dim, generator=g)
    v = torch.randn(2, shape.kv_heads, context + new, shape.head_dim, generator=g)
    got = model.attention(q, k, v, context)
    rep = shape.heads // shape.kv_heads
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ kk.transpose(-1, -2) / math.sqrt(shape.head_dim)
    visible = torch.arange(context + new)[None, :] <= torch.arange(new)[:, None] + context
    want = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vv
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would measure")
def test_without_cuda_it_says_so_and_exits_0() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]


def test_profiles_load_by_path_without_the_package() -> None:
    """The script loads ``profiles.py`` by file path: it must import nothing from tokencake."""
    src = (ROOT / "tokencake" / "sim" / "profiles.py").read_text()
    imports = [line for line in src.splitlines() if line.startswith(("import ", "from "))]
    assert all("tokencake" not in line for line in imports), imports
