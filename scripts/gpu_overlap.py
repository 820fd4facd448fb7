"""Do the host-pool copies and the forward pass slow each other down? (CUDA only)

The simulator's GPU profiles model every offload, prefetch and demand load as a copy on a side
stream at the pinned bandwidth ``scripts/gpu_check.py`` measured, with no contention: a copy
neither slows the forward pass nor is slowed by it. This measures both halves on a real GPU with
the connector's own ``BlockCopier`` (the worker's copy helper) on a Llama-3-8B-shaped KV cache:

* copy GB/s alone, and while the compute stream runs (a) back-to-back bf16 matrix products
  (compute-bound, like a prefill) or (b) a large elementwise pass (HBM-bound, like a decode step);
* the compute loop's time alone and with the copy running beside it;
* D2H (offload lane), H2D (load lane) and both at once (an offload beside a demand load).

Only torch is needed (no vLLM); like ``gpu_check.py`` it loads the copy modules from their files
when the package cannot be imported. Usage: ``python scripts/gpu_overlap.py [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import cuda_timed as timed
from gpu_check import cuda_torch, load_copy_module, provenance

#: Llama-3-8B bf16 KV: 32 layers, 8 KV heads, head dim 128, 16-token blocks (2 MiB per block).
LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 16


def submit(copier: Any, direction: str, n: int, num_dev: int) -> list[Any]:
    """The copy (or copies, for ``both``) of ``n`` blocks; device ids spread like a free list."""
    handles = []
    if direction in ("d2h", "both"):
        handles.append(copier.copy("d2h", list(range(1, 1 + n)), list(range(n))))
    if direction in ("h2d", "both"):
        dev = list(range(num_dev - n, num_dev))
        handles.append(copier.copy("h2d", dev, list(range(n, 2 * n))))
    return handles


def copy_gbps(handles: list[Any]) -> float:
    """Bytes moved over the span of the copies (first start to last end), GB/s."""
    for h in handles:
        h.wait()
    total = sum(h.nbytes for h in handles)
    span = max(first._event_start.elapsed_time(h._event_end) / 1e3 for first in handles for h in handles)
    return total / span / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    ap.add_argument("--blocks", type=int, default=1024, help="blocks per copy (2 MiB each)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch = cuda_torch("gpu_overlap")
    if torch is None:
        return 0
    cp = load_copy_module()
    n = args.blocks
    num_dev, num_host = 4 * n, 2 * n
    caches = {
        f"layer.{i}": torch.randn((2, num_dev, BLOCK, HEADS, DIM), dtype=torch.bfloat16, device="cuda")
        for i in range(LAYERS)
    }
    copier = cp.BlockCopier(caches, num_dev, num_host)
    assert copier.is_cuda and copier.host_tensors[0].is_pinned()
    print(
        f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
        f"{n} blocks × {copier.block_bytes / 2**20:.0f} MiB per copy"
    )

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB read + 2 GiB written
    y = torch.empty_like(x)
    kernels = {
        "gemm": (lambda: torch.matmul(a, b), 2 * 8192**3, "TFLOP/s"),
        "hbm": (lambda: torch.add(x, 1.0, out=y), 2 * x.numel() * x.element_size(), "GB/s"),
    }
    for _ in range(3):  # warm up clocks, cuBLAS and the copy lanes
        for fn, _w, _u in kernels.values():
            fn()
        for d in ("d2h", "h2d"):
            copy_gbps(submit(copier, d, n, num_dev))
    torch.cuda.synchronize()

    rows: list[dict[str, Any]] = []
    for direction in ("d2h", "h2d", "both"):
        alone = [copy_gbps(submit(copier, direction, n, num_dev)) for _ in range(args.reps)]
        copy_alone = statistics.median(alone)
        copy_s = (n * copier.block_bytes * (2 if direction == "both" else 1)) / (copy_alone * 1e9)
        for name, (fn, work, unit) in kernels.items():
            per_it = statistics.median(timed(torch, fn) for _ in range(args.reps))
            iters = max(1, math.ceil(1.5 * copy_s / per_it))  # the loop outlasts the copy

            def loop(fn: Any = fn, iters: int = iters) -> None:
                for _ in range(iters):
                    fn()

            comp_alone, comp_with, gbps_with = [], [], []
            for _ in range(args.reps):
                comp_alone.append(timed(torch, loop))
                torch.cuda.synchronize()
                handles = submit(copier, direction, n, num_dev)  # waits for an idle compute stream
                comp_with.append(timed(torch, loop))
                gbps_with.append(copy_gbps(handles))
            t_alone, t_with = statistics.median(comp_alone), statistics.median(comp_with)
            g_with = statistics.median(gbps_with)
            overlap_s = min(copy_s * copy_alone / g_with, t_with)
            scale = 1e12 if unit == "TFLOP/s" else 1e9
            row = {
                "direction": direction,
                "kernel": name,
                "blocks": n,
                "copy_gbps_alone": copy_alone,
                "copy_gbps_with_compute": g_with,
                "copy_slowdown_pct": 100 * (copy_alone / g_with - 1),
                "compute_iters": iters,
                "compute_s_alone": t_alone,
                "compute_s_with_copy": t_with,
                f"compute_{unit}_alone": iters * work / t_alone / scale,
                # The extra compute time, charged to the part of the loop the copy overlapped.
                "compute_slowdown_while_copying_pct": 100 * max(t_with - t_alone, 0.0) / overlap_s,
            }
            rows.append(row)
            print(
                f"{direction:<5}{name:<5} copy {copy_alone:6.1f} GB/s alone, {g_with:6.1f} with compute "
                f"({row['copy_slowdown_pct']:+.1f} %); compute {t_alone * 1e3:7.2f} ms alone, "
                f"{t_with * 1e3:7.2f} ms with the copy "
                f"({row['compute_slowdown_while_copying_pct']:+.1f} % while copying; "
                f"{row[f'compute_{unit}_alone']:.0f} {unit} alone)"
            )
    # The copies moved what they should (a round trip through the host pool is byte-exact).
    ids = list(range(7, 7 + 64))
    before = [t[:, ids].clone() for t in caches.values()]
    copier.copy("d2h", ids, list(range(64))).wait()
    for t in caches.values():
        t[:, ids] = 0
    copier.copy("h2d", ids, list(range(64))).wait()
    torch.cuda.synchronize()
    exact = all(torch.equal(t[:, ids], bb) for t, bb in zip(caches.values(), before, strict=True))
    print(f"round trip byte-exact: {exact}")
    if args.json:
        out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "byte_exact": exact}
        out["rows"] = rows
        out["provenance"] = provenance("gpu_overlap.py")
        args.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
