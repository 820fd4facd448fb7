"""What serving the bundled model in float32 costs against bf16 on this host, and what bf16 answers.

For each round, each dtype (the order alternates between rounds) gets a fresh server with
``tokencake serve``'s defaults except ``--dtype``: the Paris question (greedy), ``--reps``
prefills of a ~1,400-token prompt (a new first line each time: no prefix-cache hit; 1 output
token) and ``--reps`` decodes of 128 tokens after a short prompt (``ignore_eos``). Client wall
times; medians over rounds and reps. The host's bf16 CPU flags are printed with the result.

    .venv/bin/python benchmarks/dtype_cost.py --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx

from tokencake.serving import Server, machine

PARIS = "What is the capital of France?"
#: ~1,400 prompt tokens for SmolLM2's tokenizer.
LONG = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(110))


def _ask(client: httpx.Client, model: str, prompt: str, **extra: Any) -> tuple[dict[str, Any], float]:
    """A greedy chat completion of ``prompt`` and its client wall time."""
    messages = [{"role": "user", "content": prompt}]
    started = time.perf_counter()
    resp = client.post(
        "/chat/completions", json={"model": model, "messages": messages, "temperature": 0.0, **extra}
    )
    resp.raise_for_status()
    return resp.json(), time.perf_counter() - started


def measure(dtype: str, reps: int) -> dict[str, Any]:
    """One server in ``dtype``: its Paris answer, prefill and decode times."""
    server = Server(port=0, extra_args=["--dtype", dtype])
    server.start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=600.0) as client:
            paris, _ = _ask(client, server.model, PARIS, max_tokens=40)
            _ask(client, server.model, "warm up", max_tokens=4)
            prefill, decode, prompt_tokens = [], [], 0
            for _ in range(reps):
                reply, seconds = _ask(client, server.model, f"Run {uuid.uuid4().hex}.\n{LONG}", max_tokens=1)
                prompt_tokens = reply["usage"]["prompt_tokens"]
                prefill.append(seconds)
                reply, seconds = _ask(client, server.model, "Count.", max_tokens=128, ignore_eos=True)
                decode.append(seconds / reply["usage"]["completion_tokens"])
    finally:
        server.stop()
    return {
        "dtype": dtype,
        "paris": paris["choices"][0]["message"]["content"],
        "prompt_tokens": prompt_tokens,
        "prefill_s": prefill,
        "decode_s_per_token": decode,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds over both dtypes (default 2)")
    p.add_argument("--reps", type=int, default=3, help="prefills and decodes per server (default 3)")
    p.add_argument("--json", dest="json_path", help="also write the result here")
    args = p.parse_args(argv)

    flags = [f for f in machine.BF16_CPU_FLAGS if f in machine.CPUINFO.read_text()]
    runs = []
    for r in range(args.rounds):
        for dtype in ("bfloat16", "float32") if r % 2 == 0 else ("float32", "bfloat16"):
            runs.append(measure(dtype, args.reps))
            print(json.dumps(runs[-1]), flush=True)
    summary: dict[str, Any] = {"bf16_cpu_flags": flags, "native_bf16": machine.cpu_has_bf16()}
    for dtype in ("bfloat16", "float32"):
        mine = [run for run in runs if run["dtype"] == dtype]
        summary[dtype] = {
            "paris": sorted({run["paris"] for run in mine}),
            "prefill_s": statistics.median(s for run in mine for s in run["prefill_s"]),
            "decode_ms_per_token": 1000
            * statistics.median(s for run in mine for s in run["decode_s_per_token"]),
        }
    summary["float32/bf16 prefill"] = summary["float32"]["prefill_s"] / summary["bfloat16"]["prefill_s"]
    summary["float32/bf16 decode"] = (
        summary["float32"]["decode_ms_per_token"] / summary["bfloat16"]["decode_ms_per_token"]
    )
    print(json.dumps(summary, indent=2))
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump({"summary": summary, "runs": runs}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
