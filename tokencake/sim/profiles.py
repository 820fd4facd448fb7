"""Hardware profiles: what a step costs, how big a KV block is, how fast blocks cross the bus.

A step's time is ``step_s + prefill_s_per_token × new tokens + attn_s_per_token_ctx × Σ(new tokens
× their context) + decode_s_per_seq × decoding sequences + decode_s_per_ctx_token × their
context`` (``HardwareProfile.step_time``). Copies run at ``*_bytes_per_s`` plus ``copy_base_s`` per
job; on the CPU backend they take the same cores as the forward (``copies_async=False``: a step that
copies lasts longer), on a GPU saves and prefetches each run on a side stream of their own
(``copies_async=True``) and only a *demand* load delays its step; a side-stream copy that starts
while the other direction's is running gets ``duplex_share`` of its rate, and a step that runs
while one is in flight lasts ``copy_compute_slowdown`` longer.

``cpu-measured`` and ``cpu-fast`` are the project's two kinds of 2-core host (vLLM-CPU,
SmolLM2-135M, float32, 128-token blocks): ``step_s``, ``prefill_s_per_token``,
``attn_s_per_token_ctx`` (and on ``cpu-fast`` ``decode_s_per_seq``) are a grid search against each
host's stored ``ci`` and ``headroom`` runs (``tokencake.sim.validate.fit``); its other runs are held
out. Copy bandwidths are the ones the runs measured.

``h200-llama3-8b``'s step constants are fitted to the step times measured on an H200
(``tokencake.sim.calibrate.fit_step``: an eager torch forward of a Llama-3-8B-shaped model), its
copy constants to the pinned copies measured there (``calibrate.fit_copies``).
``h100-llama3-8b`` has no measurement: the H200's fit with the memory-bound terms scaled by the
two datasheets' HBM bandwidths. ``docs/simulation.md`` has the calibration and its residuals.
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
    #: Peak HBM bandwidth (GPU profiles; 0: not a GPU), the reference of ``decode_share``.
    hbm_bytes_per_s: float = 0.0
    #: A side-stream copy that starts while the other direction's is running gets this share of its
    #: rate (the two directions share the link); 1: no contention.
    duplex_share: float = 1.0
    #: A step that runs while a side-stream copy is in flight lasts this fraction longer.
    copy_compute_slowdown: float = 0.0

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    def step_time(
        self, prefill_tokens: int = 0, prefill_pairs: int = 0, decodes: int = 0, decode_ctx: int = 0
    ) -> float:
        """Seconds of one forward step: ``prefill_tokens`` new prompt tokens with ``prefill_pairs``
        (token, context token) pairs, and ``decodes`` sequences decoding one token each after
        ``decode_ctx`` context tokens in all."""
        return (
            self.step_s
            + self.prefill_s_per_token * prefill_tokens
            + self.attn_s_per_token_ctx * prefill_pairs
            + self.decode_s_per_seq * decodes
            + self.decode_s_per_ctx_token * decode_ctx
        )

    @property
    def decode_share(self) -> float | None:
        """The share of peak HBM bandwidth at which decode reads KV (None: not a GPU profile)."""
        if not self.hbm_bytes_per_s or not self.decode_s_per_ctx_token:
            return None
        return self.kv_bytes_per_token / (self.decode_s_per_ctx_token * self.hbm_bytes_per_s)

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
_H200_HBM_BYTES_PER_S = 4.8e12
#: The H200's step constants, fitted to its measured steps (``tokencake.sim.calibrate.fit_step``;
#: 3 significant digits). Decode reads KV at ~52 % of peak HBM bandwidth (``decode_share``).
_H200_STEP: dict[str, float] = {
    "step_s": 3.47e-3,
    "prefill_s_per_token": 2.12e-5,
    "attn_s_per_token_ctx": 1.67e-9,
    "decode_s_per_seq": 2.69e-5,
    "decode_s_per_ctx_token": 5.30e-8,
}
#: The H200's copy constants, fitted to its measured pinned copies (``calibrate.fit_copies``).
_H200_COPIES: dict[str, float] = {
    "d2h_bytes_per_s": 55.4e9,
    "h2d_bytes_per_s": 55.3e9,
    "copy_base_s": 1.94e-4,
    "duplex_share": 0.909,
    "copy_compute_slowdown": 0.0239,
}
#: Step terms bound by HBM bandwidth (the pass over the weights, decode's KV read); the others are
#: bound by compute, the same dense bf16 FLOPS on an H100 and an H200.
_MEMORY_BOUND = ("step_s", "decode_s_per_ctx_token")


def _gpu(
    name: str,
    description: str,
    *,
    hbm_bytes_per_s: float,
    kv_gib: float,
    pcie: float | None,
    sources: str,
) -> HardwareProfile:
    """A Llama-3-8B server on a GPU: the H200's fitted constants, the memory-bound terms scaled by
    this GPU's HBM bandwidth; copies as measured on the H200 unless ``pcie`` sets both rates."""
    scale = _H200_HBM_BYTES_PER_S / hbm_bytes_per_s
    step = {k: v * scale if k in _MEMORY_BOUND else v for k, v in _H200_STEP.items()}
    copies = dict(_H200_COPIES)
    if pcie is not None:
        copies.update(d2h_bytes_per_s=pcie, h2d_bytes_per_s=pcie)
    return HardwareProfile(
        name=name,
        description=description,
        block_size=16,
        kv_bytes_per_token=_LLAMA3_8B_KV,
        device_blocks=int(kv_gib * 2**30 / (16 * _LLAMA3_8B_KV)),
        host_blocks=int(512 * 2**30 / (16 * _LLAMA3_8B_KV)),
        max_batched_tokens=8192,
        max_num_seqs=256,
        copies_async=True,
        sources=sources,
        hbm_bytes_per_s=hbm_bytes_per_s,
        **step,
        **copies,
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
    # The same setup on the faster kind of host: about 2.5 x fewer seconds per computed token.
    # Copies as its runs with the host pool populated at start measured them (offloads 8.8-10 GB/s,
    # loads 8.3-8.4 GB/s); its runs that saved into first-touch pages (~0.13 GB/s) are replayed at
    # their own rates (stored.Fixture.copies_as_measured, docs/reliability.md).
    "cpu-fast": _CPU_MEASURED.with_(
        name="cpu-fast",
        description="as cpu-measured, on the faster kind of 2-core host",
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
        sources="not measured: the H200 fit with its memory-bound terms scaled to the NVIDIA H100 "
        "datasheet's 3.35 TB/s (989 TFLOPS bf16 dense, as the H200); PCIe 5 assumed at 50 GB/s",
    ),
    "h200-llama3-8b": _gpu(
        "h200-llama3-8b",
        "H200 SXM 141 GB, Llama-3-8B bf16, ~110 GiB KV, 16-token blocks, 55 GB/s pinned copies, 512 GiB host",
        hbm_bytes_per_s=_H200_HBM_BYTES_PER_S,
        kv_gib=110,
        pcie=None,
        sources="step and copy constants fitted to H200 measurements (tokencake.sim.calibrate: "
        "docs/bench/gpu-step.json, gpu-overlap-{128,1024,2048}.json); NVIDIA H200 datasheet "
        "(4.8 TB/s, 141 GB); Llama 3 8B config",
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
    "duplex_share",
    "copy_compute_slowdown",
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
        if name == "duplex_share" and not 0 < value <= 1:
            raise ValueError(f"bad profile override {item!r}: a share, > 0 and <= 1")
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
