"""What a copy into a fresh host pool costs: first write to lazily backed pages vs populated ones.

The host pool is written by offloads (device → host). On a virtual machine whose memory the
hypervisor backs lazily, the first write to each page is a fault the host serves, so offloads into
a fresh pool run far below memory bandwidth; ``_host_memory.populated_host_buffer`` maps the pool with
``MAP_POPULATE`` instead. This measures, in one process and in shuffled order, per trial:

* ``lazy_first``: copying into a fresh ``torch.empty`` buffer (pages backed at first touch);
* ``populated_first``: copying into a fresh ``populated_host_buffer`` (the time to map it apart);
* ``populate_s_per_gib``: the time ``populated_host_buffer`` takes, per GiB (paid once, when the
  server starts, as vLLM's own CPU KV cache pays it when it is zeroed);
* ``warm``: copying again into memory already written.

    python benchmarks/first_touch.py --out docs/bench/first-touch.json     # ~10 s
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from tokencake.bench.environment import versions
from tokencake.bench.intervals import mean_ci
from tokencake.serving.vllm._host_memory import populated_host_buffer


def _copy_gbps(dst: torch.Tensor, src: torch.Tensor) -> float:
    t = time.perf_counter()
    dst.copy_(src)
    return src.numel() / (time.perf_counter() - t) / 1e9


def trial(nbytes: int, kind: str, src: torch.Tensor, keep: list[torch.Tensor]) -> dict[str, float]:
    """One buffer of ``kind``, kept alive in ``keep`` so that no trial reuses pages an earlier one
    freed (those may still be backed, which would flatter the later trial)."""
    if kind == "lazy":
        dst = torch.empty(nbytes, dtype=torch.uint8)
        keep.append(dst)
        first = _copy_gbps(dst, src)
        return {"lazy_first_gbps": first, "warm_gbps": _copy_gbps(dst, src)}
    t = time.perf_counter()
    dst = populated_host_buffer(nbytes)
    mapped = time.perf_counter() - t
    keep.append(dst)
    return {"populated_first_gbps": _copy_gbps(dst, src), "populate_s_per_gib": mapped / (nbytes / 2**30)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="buffer size per trial")
    ap.add_argument("--trials", type=int, default=5, help="trials of each kind, shuffled")
    ap.add_argument("--out", type=Path, default=Path("first-touch.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    nbytes = args.mib << 20
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    kinds = ["lazy", "populated"] * args.trials
    random.Random(0).shuffle(kinds)
    samples: dict[str, list[float]] = {}
    keep: list[torch.Tensor] = []
    for kind in kinds:
        for key, value in trial(nbytes, kind, src, keep).items():
            samples.setdefault(key, []).append(value)
    summary = {k: mean_ci(v) for k, v in samples.items()}
    summary["populated_over_lazy"] = statistics.fmean(samples["populated_first_gbps"]) / statistics.fmean(
        samples["lazy_first_gbps"]
    )
    doc = {
        "kind": "tokencake-first-touch",
        "mib": args.mib,
        "trials": args.trials,
        "order": kinds,
        "samples": samples,
        "summary": summary,
        "versions": versions(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    for k, v in summary.items():
        print(k, v)


if __name__ == "__main__":
    main()
