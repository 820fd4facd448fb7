"""What the connector reads from vLLM's config and ``kv_connector_extra_config``: the KV geometry,
the host pool's size, the policy knobs (``Options``), the prefill profile's file, and the events
listener's address and key. Every bad value is logged and replaced by its default: a typo in the
extra config never stops vLLM from starting.
"""

from __future__ import annotations

import logging
import math
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokencake.serving.event_api import EVENTS_API_KEY_ENV
from tokencake.serving.host_pool import blocks_for_gib
from tokencake.serving.model import tokencake_home
from tokencake.serving.options import RESERVE_WAIT_FROM, RETURN_RESERVE, extra_bool
from tokencake.serving.policies import POLICY_NAMES
from tokencake.serving.profile import profile_path
from tokencake.serving.spatial import ADMISSIONS
from tokencake.serving.vllm.scheduler_side import Options

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm.tokencake")

DEFAULT_HOST_POOL_GIB = 1.0


def geometry(kv_cache_config: KVCacheConfig) -> tuple[int, int, int]:
    """(block_size, bytes per block across layers, device blocks); raises if unsupported."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"{len(groups)} KV cache groups (hybrid models) are not supported")
    spec = groups[0].kv_cache_spec
    block_bytes = int(spec.page_size_bytes) * len(groups[0].layer_names)
    return int(spec.block_size), block_bytes, int(kv_cache_config.num_blocks)


def check_block_size(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Raise when vLLM's scheduler counts blocks of another size than the KV spec's: with decode
    context parallelism over a sharded spec, a scheduler block (and its hash) spans ``dcp`` spec
    blocks, and every position the connector maps between hashes and block ids would be off."""
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    if dcp > 1 and getattr(spec, "dcp_sharded", False):
        raise ValueError(f"decode context parallelism ({dcp}) is not supported")


def host_pool_blocks(extra: dict[str, Any], block_bytes: int) -> int:
    """Host pool size in blocks from ``host_pool_blocks`` or ``host_pool_gib`` (same on both roles)."""
    if extra.get("host_pool_blocks") is not None:
        n = int(extra["host_pool_blocks"])
        if n < 0:
            raise ValueError(f"host_pool_blocks must be >= 0, got {n}")
        return n
    gib = float(extra.get("host_pool_gib", DEFAULT_HOST_POOL_GIB))
    return blocks_for_gib(gib, block_bytes)


def profile_file(vllm_config: VllmConfig, extra: Mapping[str, Any], cuda: bool) -> Path | None:
    """Where this model's prefill profile lives on this hardware (None: ``profile_dir=off``)."""
    where = str(extra.get("profile_dir") or "").strip()
    if where.lower() in ("off", "none", "false", "0"):
        return None
    directory = Path(where).expanduser() if where else tokencake_home() / "profiles"
    model_config = getattr(vllm_config, "model_config", None)
    model = str(getattr(model_config, "model", "model"))
    dtype = str(getattr(model_config, "dtype", "")).replace("torch.", "")
    device = torch.cuda.get_device_name(0) if cuda else f"cpu{os.cpu_count()}-{platform.machine()}"
    return profile_path(directory, model, f"{device}-{dtype}")


def extra_choice(extra: Mapping[str, Any], name: str, choices: Sequence[str], default: str) -> str:
    """A named choice from ``kv_connector_extra_config`` (case and spaces ignored); an unknown
    one keeps ``default`` (logged)."""
    raw = extra.get(name)
    if not raw:
        return default
    value = str(raw).strip().lower()
    if value in choices:
        return value
    log.warning("TokenCake: unknown %s %r (choose from %s); using %s", name, raw, ", ".join(choices), default)
    return default


def lookahead_tokens(vllm_config: VllmConfig) -> int:
    """KV slots vLLM's admission reserves past a request's tokens (speculative decoding); 0 when
    the config cannot say (the room a hold yields is then vLLM's prompt test alone)."""
    try:
        return max(0, int(vllm_config.num_lookahead_tokens or 0))
    except Exception:
        return 0


def options_from_extra(extra: dict[str, Any]) -> Options:
    """Policy knobs from ``kv_connector_extra_config``; a bad value keeps the default (logged)."""
    opts = Options()
    for name in (
        "offload",
        "prefetch",
        "demand_load",
        "early_save",
        "demote",
        "hold_prefetched",
        "critical_last",
        "critical_spare_late",
    ):
        setattr(opts, name, extra_bool(extra, name, getattr(opts, name)))
    for name, choices in (
        ("policy", POLICY_NAMES),
        ("critical_reserve_wait_from", RESERVE_WAIT_FROM),
        ("admission", tuple(ADMISSIONS)),
        ("return_reserve", RETURN_RESERVE),
    ):
        setattr(opts, name, extra_choice(extra, name, choices, getattr(opts, name)))
    numeric: dict[str, type] = {
        "policy_seed": int,
        "keep_after_end_s": float,
        "usage_threshold": float,
        "prefetch_margin_s": float,
        "end_grace_s": float,
        "prefetch_reserve_frac": float,
        "critical_reserve_frac": float,
        "critical_reserve_wait_s": float,
        "return_reserve_frac": float,
        "admission_wait_s": float,
        "job_timeout_s": float,
        "reevaluate_max_s": float,
        "min_waiting": int,
    }
    for name, kind in numeric.items():
        if name not in extra:
            continue
        try:
            value = kind(extra[name])
            if not math.isfinite(value) or value < 0:
                raise ValueError("must be a finite number >= 0")
        except (TypeError, ValueError, OverflowError) as exc:
            log.warning(
                "TokenCake: ignoring %s=%r (%s); using %s", name, extra[name], exc, getattr(opts, name)
            )
            continue
        setattr(opts, name, value)
    return opts


def events_api_key(extra: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> str | None:
    """The events listener's bearer key: ``$TOKENCAKE_EVENTS_API_KEY``, else a legacy ``api_key``."""
    key = environ.get(EVENTS_API_KEY_ENV)
    if key:
        return key
    legacy = extra.get("api_key")
    if legacy:
        log.warning(
            "TokenCake: api_key in kv_connector_extra_config is visible in the process list and "
            "vLLM's logs; set %s in vLLM's environment instead",
            EVENTS_API_KEY_ENV,
        )
        return str(legacy)
    return None


def events_address(extra: Mapping[str, Any]) -> tuple[str, int] | None:
    """``(events_host, events_port)`` from the extra config; None without a port.

    Raises ``ValueError`` with a one-line reason for a port that is not an int in 0..65535.
    """
    port = extra.get("events_port")
    if port is None:
        return None
    host = str(extra.get("events_host") or "127.0.0.1")
    if isinstance(port, bool) or (isinstance(port, float) and not port.is_integer()):
        raise ValueError(f"events_port {port!r} is not a port number")
    try:
        number = int(port)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"events_port {port!r} is not a port number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"events_port {number} is out of range 0..65535")
    return host, number


__all__ = [
    "DEFAULT_HOST_POOL_GIB",
    "check_block_size",
    "events_address",
    "events_api_key",
    "extra_choice",
    "geometry",
    "host_pool_blocks",
    "lookahead_tokens",
    "options_from_extra",
    "profile_file",
]
