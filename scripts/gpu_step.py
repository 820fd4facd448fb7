"""Does the simulator's GPU step-time model match a real forward pass? (CUDA only)

Every GPU result of the simulator rests on the step-time constants of ``tokencake/sim/profiles.py``
(``step_s``, ``prefill_s_per_token``, ``attn_s_per_token_ctx``, ``decode_s_per_seq``,
``decode_s_per_ctx_token``), built from datasheet figures and assumed utilisations. This times a
real forward pass of a Llama-3-8B-shaped transformer in bf16 on the current CUDA device and sets
each measurement beside the step time the profile predicts for the same work, with the context
convention of ``tokencake.sim.engine.Engine._step_time`` (a prefill chunk of ``n`` tokens after
``c`` computed ones counts ``n × (c + n // 2)`` token-context pairs; a decode step counts its
sequence's computed tokens). Cases:

* prefill chunks with no prior context (one sequence, N new tokens);
* a 2048-token prefill chunk after 8192 / 16384 cached tokens (causal, aligned bottom right);
* decode steps: B sequences × 1 new token, each after C cached tokens.

The model: 32 layers, d_model 4096, 32 query heads, 8 KV heads of 128, SwiGLU MLP 14336 (fused
gate/up and down), RMSNorm, fused QKV, random bf16 weights (all 32 layers distinct, ~16 GB), the
LM head (vocab 128256) on the last token of each sequence only, as vLLM does. Attention is
``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels; native
GQA where the installed torch has it, else the KV heads repeated). Simplifications: rotary
embeddings are omitted (elementwise over q and k, well under 1 % of a step); the KV cache is
dense per sequence (no paging), and ONE layer's cache is allocated and reused by all 32 layers —
each layer still reads a tensor far larger than L2, so decode stays HBM-bound as in a real cache.
No scheduler, sampler, CUDA graphs or fused kernels: eager torch, so small steps pay launch
overhead that vLLM mostly avoids.

Only torch is needed (no vLLM, no tokencake import): ``profiles.py`` is loaded by file path.
``--smoke`` runs tiny shapes (on the CPU in float32 when there is no CUDA device) to exercise the
code path. Usage: ``python scripts/gpu_step.py [--json out.json] [--profile h200-llama3-8b]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import cuda_timed, cuda_torch, load_by_path, provenance

ROOT = Path(__file__).resolve().parents[1]

NOTES = (
    "Eager torch: no CUDA graphs, no fused kernels (RMSNorm+residual, SiLU-and-mul, rotary), no paged "
    "attention, rotary embeddings omitted, one layer's dense KV cache reused by all layers. For small "
    "steps this is an upper bound on what vLLM achieves: ratios > 1 at small decode batches mostly "
    "measure kernel-launch overhead, not a wrong model. The profile's step_s also carries ~2 ms of "
    "scheduler/launch overhead that a bare forward has only in part. Large prefills and large decode "
    "batches are compute- and HBM-bound and compare directly (see achieved TFLOP/s and GB/s)."
)


@dataclass(frozen=True)
class ModelShape:
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int

    def layer_params(self) -> int:
        qkv = self.d_model * (self.heads + 2 * self.kv_heads) * self.head_dim
        out = self.heads * self.head_dim * self.d_model
        return qkv + out + 3 * self.d_model * self.mlp + 2 * self.d_model

    def kv_bytes_per_token_layer(self, element_size: int) -> int:
        return 2 * self.kv_heads * self.head_dim * element_size


LLAMA3_8B = ModelShape(layers=32, d_model=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, vocab=128256)
SMOKE = ModelShape(layers=2, d_model=256, heads=4, kv_heads=2, head_dim=64, mlp=512, vocab=1000)


@dataclass(frozen=True)
class Case:
    """``batch`` sequences, each with ``new`` tokens to compute after ``context`` cached ones."""

    kind: str
    batch: int
    new: int
    context: int

    @property
    def name(self) -> str:
        if self.kind == "decode":
            return f"decode B={self.batch} C={self.context}"
        if self.context:
            return f"prefill N={self.new} after {self.context}"
        return f"prefill N={self.new}"


def cases(smoke: bool) -> list[Case]:
    """Prefill without context, prefill after context, decode grid (scaled down for ``--smoke``)."""
    prefill = (16, 64) if smoke else (512, 2048, 8192)
    chunk, contexts = (16, (32, 64)) if smoke else (2048, (8192, 16384))
    batches = (1, 4) if smoke else (1, 32, 128, 256)
    decode_ctx = (16, 64) if smoke else (1024, 4096, 16384)
    out = [Case("prefill", 1, n, 0) for n in prefill]
    out += [Case("prefill", 1, chunk, c) for c in contexts]
    out += [Case("decode", b, 1, c) for b in batches for c in decode_ctx]
    return out


def load_profiles() -> Any:
    """``tokencake/sim/profiles.py`` loaded by path (it imports only the standard library)."""
    return load_by_path("tokencake_sim_profiles", "tokencake/sim/profiles.py")


def predicted(profile: Any, case: Case) -> dict[str, float]:
    """The profile's step time for ``case``, term by term (seconds), as ``Engine._step_time`` adds it."""
    if case.kind == "decode":
        parts = {
            "step_s": profile.step_s,
            "decode_s_per_seq": profile.decode_s_per_seq * case.batch,
            "decode_s_per_ctx_token": profile.decode_s_per_ctx_token * case.batch * case.context,
        }
    else:
        pairs = case.batch * case.new * (case.context + case.new // 2)
        parts = {
            "step_s": profile.step_s,
            "prefill_s_per_token": profile.prefill_s_per_token * case.batch * case.new,
            "attn_s_per_token_ctx": profile.attn_s_per_token_ctx * pairs,
        }
    parts["total_s"] = sum(parts.values())
    return parts


def work(shape: ModelShape, case: Case, element_size: int) -> tuple[float, float]:
    """(FLOPs, minimum HBM bytes) of one forward: weights once, plus the KV the attention reads."""
    tokens = case.batch * case.new
    seen = case.batch * (case.new * case.context + case.new * (case.new + 1) // 2)
    flops = 2 * shape.layer_params() * shape.layers * tokens + 2 * shape.d_model * shape.vocab * case.batch
    flops += 4 * shape.layers * shape.heads * shape.head_dim * seen
    weights = (shape.layer_params() * shape.layers + shape.vocab * shape.d_model) * element_size  # + LM head
    kv = shape.layers * case.batch * (case.context + case.new) * shape.kv_bytes_per_token_layer(element_size)
    return float(flops), float(weights + kv)


class Model:
    """Random-weight Llama-shaped decoder; one layer's KV cache, shared by every layer."""

    def __init__(self, torch: Any, shape: ModelShape, device: str, dtype: Any) -> None:
        self.torch, self.shape, self.device, self.dtype = torch, shape, device, dtype
        self.F = torch.nn.functional
        s = shape

        def w(*size: int) -> Any:
            return torch.empty(size, device=device, dtype=dtype).normal_(std=1.0 / math.sqrt(size[-1]))

        self.embed = w(s.vocab, s.d_model)
        self.lm_head = w(s.vocab, s.d_model)
        self.final_norm = torch.ones(s.d_model, device=device, dtype=dtype)
        self.layers = [
            {
                "norm1": torch.ones(s.d_model, device=device, dtype=dtype),
                "qkv": w((s.heads + 2 * s.kv_heads) * s.head_dim, s.d_model),
                "o": w(s.d_model, s.heads * s.head_dim),
                "norm2": torch.ones(s.d_model, device=device, dtype=dtype),
                "gate_up": w(2 * s.mlp, s.d_model),
                "down": w(s.d_model, s.mlp),
            }
            for _ in range(s.layers)
        ]
        self.k_cache: Any = None
        self.v_cache: Any = None
        self.attn_mode = "gqa"

    def set_cache(self, batch: int, tokens: int) -> None:
        """A dense [batch, kv_heads, tokens, head_dim] K and V cache (random contents)."""
        self.k_cache = self.v_cache = None
        if tokens:
            size = (batch, self.shape.kv_heads, tokens, self.shape.head_dim)
            self.k_cache = self.torch.empty(size, device=self.device, dtype=self.dtype).normal_()
            self.v_cache = self.torch.empty(size, device=self.device, dtype=self.dtype).normal_()

    def norm(self, x: Any, weight: Any) -> Any:
        if hasattr(self.F, "rms_norm"):
            return self.F.rms_norm(x, (x.shape[-1],), weight, 1e-5)
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * self.torch.rsqrt(var + 1e-5)).to(x.dtype) * weight

    def attention(self, q: Any, k: Any, v: Any, context: int) -> Any:
        """SDPA over the new tokens' queries; ``context`` cached tokens precede them in k, v."""
        torch, n = self.torch, q.shape[2]
        kwargs: dict[str, Any] = {}
        if n > 1 and context == 0:
            kwargs["is_causal"] = True
        elif n > 1:
            kwargs["attn_mask"] = lower_right_mask(torch, n, context + n, q.device)
        if self.attn_mode == "gqa":
            kwargs["enable_gqa"] = True
        else:
            rep = self.shape.heads // self.shape.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        with fast_kernels(torch, restrict=q.is_cuda and self.attn_mode != "math"):
            return self.F.scaled_dot_product_attention(q, k, v, **kwargs)

    def forward(self, tokens: Any, context: int) -> Any:
        """Logits of each sequence's last token; tokens is [batch, new]."""
        s, F = self.shape, self.F
        b, n = tokens.shape
        h = F.embedding(tokens, self.embed)
        for layer in self.layers:
            qkv = F.linear(self.norm(h, layer["norm1"]), layer["qkv"])
            q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
            q = q.view(b, n, s.heads, s.head_dim).transpose(1, 2)
            k = k.view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
            v = v.view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
            if context:  # write the new tokens' K, V after the cached ones; attend over all of it
                self.k_cache[:, :, context : context + n] = k
                self.v_cache[:, :, context : context + n] = v
                k, v = self.k_cache, self.v_cache
            o = self.attention(q, k, v, context).transpose(1, 2).reshape(b, n, s.heads * s.head_dim)
            h = h + F.linear(o, layer["o"])
            gate, up = F.linear(self.norm(h, layer["norm2"]), layer["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer["down"])
        return F.linear(self.norm(h[:, -1], self.final_norm), self.lm_head)


def lower_right_mask(torch: Any, n: int, total: int, device: Any) -> Any:
    """Causal mask aligned bottom right: query i sees every cached token and new tokens <= i."""
    try:
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(n, total)
    except ImportError:
        rows = torch.arange(n, device=device).unsqueeze(1) + (total - n)
        return torch.arange(total, device=device).unsqueeze(0) <= rows


@contextlib.contextmanager
def fast_kernels(torch: Any, restrict: bool) -> Iterator[None]:
    """On CUDA, allow only the flash / memory-efficient SDPA kernels (fail rather than go slow)."""
    if not restrict:
        yield
        return
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        yield
        return
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        yield


def timer(torch: Any, on_cuda: bool) -> Callable[[Callable[[], Any]], float]:
    """Seconds one call of ``fn`` takes: CUDA events on the GPU, wall time on the CPU."""

    def cuda_time(fn: Callable[[], Any]) -> float:
        return cuda_timed(torch, fn)

    def cpu_time(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return cuda_time if on_cuda else cpu_time


def run_case(model: Model, case: Case, repeats: int, warmup: int, clock: Any) -> dict[str, Any]:
    """Median and minimum seconds of the case's forward; picks the first attention mode that runs."""
    torch = model.torch
    model.set_cache(case.batch, case.context + case.new if case.context else 0)
    tokens = torch.randint(0, model.shape.vocab, (case.batch, case.new), device=model.device)

    def step() -> None:
        with torch.inference_mode():
            model.forward(tokens, case.context)

    errors = []
    for mode in ("gqa", "repeat_kv", "math"):
        model.attn_mode = mode
        try:
            with warnings.catch_warnings():  # SDPA's "kernel not used because ..." lines
                warnings.simplefilter("ignore")
                step()
            break
        except (RuntimeError, TypeError) as exc:  # no kernel for these shapes / no enable_gqa
            if "out of memory" in str(exc):
                raise  # another mode needs more memory, not less
            errors.append(f"{mode}: {(str(exc).splitlines() or [type(exc).__name__])[0][:200]}")
    else:
        raise RuntimeError(f"{case.name}: no attention mode ran: {errors}")
    for _ in range(warmup):
        step()
    times = [clock(step) for _ in range(repeats)]
    return {"measured_s": statistics.median(times), "min_s": min(times), "attn": mode, "attn_errors": errors}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    ap.add_argument("--profile", default="h200-llama3-8b", help="profile whose constants are checked")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per case (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs per case before timing")
    ap.add_argument("--max-kv-gib", type=float, default=40.0, help="skip a case whose one-layer KV is larger")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on the CPU without CUDA")
    args = ap.parse_args(argv)
    if args.smoke:
        import torch

        on_cuda = torch.cuda.is_available()
    else:
        torch = cuda_torch("gpu_step")
        if torch is None:
            return 0
        on_cuda = True
    profiles = load_profiles()
    if args.profile not in profiles.PROFILES:
        ap.error(f"unknown profile {args.profile!r}; choose from {', '.join(profiles.PROFILES)}")
    profile = profiles.PROFILES[args.profile]
    shape = SMOKE if args.smoke else LLAMA3_8B
    device, dtype = ("cuda", torch.bfloat16) if on_cuda else ("cpu", torch.float32)
    element_size = torch.empty((), dtype=dtype).element_size()
    device_name = torch.cuda.get_device_name() if on_cuda else "cpu"
    torch.manual_seed(0)
    model = Model(torch, shape, device, dtype)
    print(f"device: {device_name}, torch {torch.__version__}, {dtype}; profile {profile.name}; {shape}")
    clock = timer(torch, on_cuda)

    rows: list[dict[str, Any]] = []
    for case in cases(args.smoke):
        row: dict[str, Any] = {"case": case.name, **asdict(case)}
        kv_gib = case.batch * (case.context + case.new) * shape.kv_bytes_per_token_layer(element_size) / 2**30
        pred = predicted(profile, case)
        row.update(kv_gib_per_layer=kv_gib, predicted_s=pred["total_s"], predicted_terms=pred)
        if case.context and kv_gib > args.max_kv_gib:
            row.update(skipped=True, reason=f"one layer's KV {kv_gib:.1f} GiB > --max-kv-gib")
            rows.append(row)
            print(f"{case.name:<28} skipped: {row['reason']}")
            continue
        try:
            row.update(run_case(model, case, args.repeats, args.warmup, clock), skipped=False)
        except RuntimeError as exc:  # out of memory, or no attention kernel: the other cases still run
            row.update(skipped=True, reason=f"failed: {(str(exc).splitlines() or ['?'])[0][:300]}")
            rows.append(row)
            print(f"{case.name:<28} {row['reason']}")
            continue
        finally:
            model.set_cache(0, 0)
            if on_cuda:
                torch.cuda.empty_cache()
        flops, nbytes = work(shape, case, element_size)
        row["ratio"] = row["measured_s"] / row["predicted_s"]
        row["achieved_tflops"] = flops / row["measured_s"] / 1e12
        row["achieved_hbm_gbps"] = nbytes / row["measured_s"] / 1e9
        rows.append(row)
        print(
            f"{case.name:<28} measured {row['measured_s'] * 1e3:9.2f} ms (min {row['min_s'] * 1e3:9.2f})"
            f"  predicted {row['predicted_s'] * 1e3:9.2f} ms  ratio {row['ratio']:6.2f}"
            f"  {row['achieved_tflops']:7.1f} TFLOP/s {row['achieved_hbm_gbps']:7.0f} GB/s  [{row['attn']}]"
        )

    head = f"{'case':<28}{'B':>5}{'N':>6}{'C':>7}{'measured ms':>13}{'min ms':>10}"
    head += f"{'predicted ms':>14}{'ratio':>8}"
    print()
    print(head)
    print("-" * len(head))
    for r in rows:
        left = f"{r['case']:<28}{r['batch']:>5}{r['new']:>6}{r['context']:>7}"
        if r["skipped"]:
            status = "failed" if r["reason"].startswith("failed") else "skipped"
            print(f"{left}{status:>13}{'':>10}{r['predicted_s'] * 1e3:>14.2f}")
            continue
        print(
            f"{left}{r['measured_s'] * 1e3:>13.2f}{r['min_s'] * 1e3:>10.2f}"
            f"{r['predicted_s'] * 1e3:>14.2f}{r['ratio']:>8.2f}"
        )
    print(f"\n{NOTES}")
    if args.json:
        out = {
            "device": device_name,
            "torch": torch.__version__,
            "dtype": str(dtype),
            "profile": profile.name,
            "smoke": args.smoke,
            "model": asdict(shape),
            "repeats": args.repeats,
            "rows": rows,
            "notes": NOTES,
            "provenance": provenance("gpu_step.py"),
        }
        args.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    return 1 if any(r.get("reason", "").startswith("failed") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
