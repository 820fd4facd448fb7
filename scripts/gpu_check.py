"""Bandwidth of TokenCake's host-pool copy path vs torch peak copies (CUDA only).

What it measures: ``tokencake.serving.vllm._copy.BlockCopier`` — the exact helper the worker
side of the connector uses — copying whole KV blocks between a synthetic device KV cache and the
pinned host pool, in both directions, for contiguous block ids, scattered block ids (both sides),
"dev-scatter" (scattered device ids into consecutive host slots, the usual free-list case) and two layouts
(vLLM-CUDA ``[2, blocks, block_size, heads, dim]`` and vLLM-CPU ``[blocks, heads, block_size, 2*dim]``).
The reference is one large contiguous pinned copy with plain torch (the PCIe/NVLink-C2C peak).

Only torch is needed (no vLLM). The copy modules are loaded from their files, without running the
package ``__init__`` files, when the ``tokencake`` package cannot be imported (e.g. its client
dependencies are missing on the device machine): see :func:`load_tokencake_module`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def load_by_path(name: str, relpath: str) -> Any:
    """A module of this repository loaded from its file (no package import: the device machine
    may lack the package's dependencies); registered so dataclasses can resolve it."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_tokencake_module(name: str) -> Any:
    """``tokencake.<name>``, imported as usual or, where the package cannot be imported (the device
    machine may lack its dependencies), with ``tokencake`` and each sub-package above the module
    registered as a bare package over its folder: no package ``__init__`` runs, and the module's
    imports of its siblings load them from their files."""
    full = f"tokencake.{name}"
    try:
        return importlib.import_module(full)
    except Exception:
        pass
    parts = full.split(".")
    for i in range(1, len(parts)):
        package = types.ModuleType(".".join(parts[:i]))
        package.__path__ = [str(ROOT.joinpath(*parts[:i]))]
        sys.modules[package.__name__] = package
    return importlib.import_module(full)


def load_copy_module() -> Any:
    """The module of ``BlockCopier`` (see :func:`load_tokencake_module`)."""
    return load_tokencake_module("serving.vllm._copy")


def provenance(script: str) -> dict[str, Any]:
    """What ran, for a results file: the commit and dirty flag (from git, or ``TOKENCAKE_COMMIT``
    where the copy has no ``.git``, as on the device machine), and a SHA-256 of the script and of
    every ``tokencake/**/*.py`` file, which identify the code even without git."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--", "tokencake", "scripts") if commit else None
    code = hashlib.sha256()
    for path in sorted((ROOT / "tokencake").rglob("*.py")):
        code.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return {
        "commit": commit or os.environ.get("TOKENCAKE_COMMIT") or None,
        "dirty": None if status is None else bool(status),
        "script": f"scripts/{script}",
        "script_sha256": hashlib.sha256((ROOT / "scripts" / script).read_bytes()).hexdigest(),
        "tokencake_py_sha256": code.hexdigest(),
        "host": platform.node(),
    }


def cuda_timed(torch: Any, fn: Any) -> float:
    """Seconds ``fn`` keeps the current CUDA stream busy (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def cuda_torch(script: str) -> Any:
    """torch, if it is installed and sees a CUDA device; else None (said in one line)."""
    try:
        import torch
    except ImportError:
        print(f"{script}: torch is not installed; nothing to measure.")
        return None
    if not torch.cuda.is_available():
        print(f"{script}: no CUDA device visible (torch.cuda.is_available() is False); nothing to measure.")
        return None
    return torch


def peak(torch: Any, nbytes: int, reps: int) -> dict[str, float]:
    """GB/s of one contiguous pinned-host <-> device copy of ``nbytes`` (best of ``reps``)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        best = float("inf")
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best / 1e9
    del host, dev
    torch.cuda.empty_cache()
    return out


def measure(
    torch: Any, copier: Any, direction: str, dev_ids: list[int], slots: list[int], reps: int
) -> float:
    """GB/s of ``copier.copy`` (best of ``reps``, wall time until the copy's event completed)."""
    best = float("inf")
    for _ in range(reps + 1):  # first run warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = copier.copy(direction, dev_ids, slots)
        handle.wait()
        best = min(best, time.perf_counter() - t0)
    return len(dev_ids) * copier.block_bytes / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = ap.parse_args()
    torch = cuda_torch("gpu_check")
    if torch is None:
        return 0
    cp = load_copy_module()
    plan = load_tokencake_module("serving.vllm._copy_plan")
    kv = load_tokencake_module("serving.vllm._kv_layout")
    reps = 2 if args.quick else 5
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    ref = peak(torch, 1 << 30, reps)
    print(f"torch peak (1 GiB contiguous pinned copy): D2H {ref['d2h']:.1f} GB/s, H2D {ref['h2d']:.1f} GB/s")

    # A Llama-3-8B-like KV cache: 32 layers, 8 KV heads, head dim 128, bf16, 16-token blocks.
    layers, heads, dim, bs = 32, 8, 128, 16
    num_dev, num_host = 2048, 1024
    layouts = {
        "cuda [2,B,bs,H,D]": (2, num_dev, bs, heads, dim),
        "cpu [B,H,bs,2D]": (num_dev, heads, bs, 2 * dim),
    }
    sizes = [16, 256] if args.quick else [16, 64, 256, 1024]
    rows: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)
    for layout, shape in layouts.items():
        caches = {
            f"layer.{i}": torch.empty(shape, dtype=torch.bfloat16, device="cuda") for i in range(layers)
        }
        copier = cp.BlockCopier(caches, num_dev, num_host)
        assert copier.is_cuda and copier.host_tensors[0].is_pinned()
        # Correctness spot check: a round trip is byte-exact.
        for t in caches.values():
            t.normal_()
        # Per-run copies (few runs) and the staging path (scattered ids, consecutive slots).
        exact = True
        scattered = torch.randperm(num_dev, generator=gen)[:300].tolist()
        for ids in ([5, 6, 7, 100], scattered):
            slots = list(range(len(ids)))
            before = [t.movedim(copier_block_dim(kv, t, num_dev), 0)[ids].clone() for t in caches.values()]
            copier.copy("d2h", ids, slots).wait()
            for t in caches.values():
                t.movedim(copier_block_dim(kv, t, num_dev), 0)[ids] = 0
            copier.copy("h2d", ids, slots).wait()
            torch.cuda.synchronize()
            exact = exact and all(
                torch.equal(t.movedim(copier_block_dim(kv, t, num_dev), 0)[ids], b)
                for t, b in zip(caches.values(), before, strict=True)
            )
        for n in sizes:
            for pattern in ("contiguous", "scattered", "dev-scatter"):
                if pattern == "contiguous":
                    dev_ids, slots = list(range(10, 10 + n)), list(range(n))
                elif pattern == "dev-scatter":
                    dev_ids = torch.randperm(num_dev - 1, generator=gen)[:n].add(1).tolist()
                    slots = list(range(n))
                else:
                    dev_ids = torch.randperm(num_dev - 1, generator=gen)[:n].add(1).tolist()
                    slots = torch.randperm(num_host, generator=gen)[:n].tolist()
                d2h = measure(torch, copier, "d2h", dev_ids, slots, reps)
                h2d = measure(torch, copier, "h2d", dev_ids, slots, reps)
                rows.append(
                    {
                        "layout": layout,
                        "pattern": pattern,
                        "blocks": n,
                        "mib": n * copier.block_bytes / 2**20,
                        "runs": len(plan.runs(dev_ids, slots)),
                        "d2h_gbps": d2h,
                        "h2d_gbps": h2d,
                        "d2h_pct_peak": 100 * d2h / ref["d2h"],
                        "h2d_pct_peak": 100 * h2d / ref["h2d"],
                        "byte_exact": exact,
                    }
                )
        del caches, copier
        torch.cuda.empty_cache()

    head = f"{'layout':<20}{'ids':<12}{'blocks':>7}{'MiB':>9}{'runs':>6}{'D2H GB/s':>10}{'%pk':>6}"
    head += f"{'H2D GB/s':>10}{'%pk':>6}  exact"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['layout']:<20}{r['pattern']:<12}{r['blocks']:>7}{r['mib']:>9.0f}{r['runs']:>6}"
            f"{r['d2h_gbps']:>10.1f}{r['d2h_pct_peak']:>6.0f}{r['h2d_gbps']:>10.1f}{r['h2d_pct_peak']:>6.0f}"
            f"  {r['byte_exact']}"
        )
    if args.json:
        out = {"peak": ref, "rows": rows, "provenance": provenance("gpu_check.py")}
        args.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    return 0 if all(r["byte_exact"] for r in rows) else 1


def copier_block_dim(kv_layout: Any, tensor: Any, num_blocks: int) -> int:
    return kv_layout.find_block_dim(tensor.shape, num_blocks)


if __name__ == "__main__":
    raise SystemExit(main())
