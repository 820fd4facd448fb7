"""The host pool's memory: exact-size allocation, RAM check, page-locking (torch only, no vLLM).

The pool is one flat buffer of exactly the size asked for, checked against the RAM this
process may still use (:func:`check_host_memory`) and, on CUDA, page-locked in place with
``cudaHostRegister``: torch's pinned allocator rounds every allocation up to a power of two (a
40 GiB pool would lock 64 GiB). If pinning fails (locked-memory limit, driver), the pool stays
pageable with one warning: copies still work, only slower. Its pages are populated when it is
allocated (:func:`populated_host_buffer`), not at their first write: on a virtual machine whose
memory the hypervisor backs lazily a first write to a page is a fault the host serves, and
offloads into a fresh pool ran at ~0.1 GB/s against ~5 GB/s into touched pages (measured on
this project's 2-core VMs) — synchronous copies inside the engine step on CPU.

:class:`HostBuffer` carves the buffer into one contiguous ``[num_host_blocks, …]`` tensor per
part of each layer (:func:`~tokencake.serving.vllm._kv_layout.copy_parts`): a host slot is one
contiguous chunk and a run of slots is one ``copy_``.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import mmap
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokencake.serving.vllm._kv_layout import copy_parts, is_dense

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.tokencake.copy")

#: Host pool layers start at multiples of this many bytes (DMA-friendly, any dtype fits).
HOST_ALIGN = 512


class HostMemoryError(RuntimeError):
    """The host pool does not fit in the RAM this process may still use."""


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f}"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2, then v1); None if unlimited."""
    for limit_path, usage_path, stat_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
            "/sys/fs/cgroup/memory/memory.stat",
        ),
    ):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is None or usage is None or limit >= 1 << 60:  # "max" or the v1 "unlimited" value
            continue
        reclaimable = 0  # page cache the kernel drops before it kills anyone
        try:
            with open(stat_path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key in ("inactive_file", "total_inactive_file") and value.strip().isdigit():
                        reclaimable = int(value)
                        break
        except OSError:
            pass
        return max(0, limit - usage + reclaimable)
    return None


def available_ram_bytes() -> int | None:
    """RAM this process can still fill: ``MemAvailable``, capped by a cgroup limit (None: unknown)."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    room = _cgroup_room()
    if room is not None:
        found.append(room)
    return min(found) if found else None


def memlock_limit_bytes() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` (None: unlimited or unknown)."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def populated_host_buffer(nbytes: int) -> torch.Tensor:
    """A ``uint8`` CPU tensor of ``nbytes`` whose pages are all backed now (``MAP_POPULATE``).

    The kernel maps the whole range in one call, far cheaper than a fault per page at the first
    copy into it (see the module docstring). Where ``MAP_POPULATE`` is not available (not Linux)
    or the mapping fails, a plain ``torch.empty`` (pages backed at first touch, as before).
    """
    import torch

    flag = getattr(mmap, "MAP_POPULATE", None)
    if nbytes <= 0 or flag is None:
        return torch.empty(max(nbytes, 0), dtype=torch.uint8, device="cpu")
    try:
        region = mmap.mmap(
            -1,
            nbytes,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flag,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
    except (OSError, ValueError) as exc:
        log.warning("TokenCake: could not map the host pool populated (%s); pages fill on first use", exc)
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    # The tensor keeps ``region`` alive (buffer protocol); the mapping goes when the tensor does.
    return torch.frombuffer(region, dtype=torch.uint8)


def check_host_memory(nbytes: int, available: int | None, *, fraction: float = 0.9) -> None:
    """Raise :class:`HostMemoryError` (one line, with the fix) when ``nbytes`` would not fit.

    At most ``fraction`` of the available RAM may go to the pool: the rest is the margin the
    OOM killer needs. Pinned pages cannot be swapped, so a pool that does not fit would take
    the whole engine down, not just TokenCake.
    """
    if available is None or nbytes <= fraction * available:
        return
    raise HostMemoryError(
        f"TokenCake host pool needs {_gib(nbytes)} GiB but only {_gib(available)} GiB of RAM is "
        f"available; lower --host-pool-gib (host_pool_gib) to at most {_gib(fraction * available)}"
    )


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error, so a failed registration is not reported later by an
    unrelated kernel launch check."""
    import torch

    fn = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if fn is not None:
        try:
            fn()
            return
        except Exception:
            pass
    for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def pin_host_memory(t: torch.Tensor) -> str | None:
    """Page-lock ``t`` in place (``cudaHostRegister``, exact size); None when pinned, else why not."""
    import torch

    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        code = int(getattr(err, "value", err))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if code == 0:
        return None
    try:
        _clear_cuda_error()
    except Exception:
        pass
    return f"cudaHostRegister returned error {code}"


def unpin_host_memory(t: torch.Tensor) -> None:
    import torch

    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception:
        pass


# ------------------------------------------------------------------ the pool's buffer


@dataclass
class Part:
    """One dense slice of a layer: ``dev[b]`` pairs with ``host[s]`` (both block-first)."""

    dev: torch.Tensor
    host: torch.Tensor
    #: Bytes of one block of this part.
    nbytes: int
    #: Runs of consecutive device blocks are contiguous: plain copies need no temporary.
    dense: bool


class HostBuffer:
    """The host pool's memory: one flat buffer of exactly the size asked for, carved into a
    contiguous ``[num_host, ...]`` tensor per part of each block-first layer view.

    ``pin``: page-lock the buffer in place; when that fails it stays pageable (one warning) and
    :attr:`pinned` is False. ``check_ram``: refuse (:class:`HostMemoryError`) a buffer larger
    than the free RAM allows. The buffer is allocated once, here, and never grows.
    """

    def __init__(self, views: list[torch.Tensor], num_host: int, *, pin: bool, check_ram: bool) -> None:
        plans = []
        total = 0
        for view in views:
            perm, outer = copy_parts(view)
            pv = view.permute(perm)
            nbytes = num_host * math.prod(pv.shape[1:]) * view.element_size()
            plans.append((view, perm, outer, pv, total))
            total = -(-(total + nbytes) // HOST_ALIGN) * HOST_ALIGN
        if check_ram:
            check_host_memory(total, available_ram_bytes())
        started = time.perf_counter()
        self.flat = populated_host_buffer(total)
        took = time.perf_counter() - started
        log.info("TokenCake: host pool of %s GiB mapped in %.1f s", _gib(total), took)
        self.pinned = False
        if pin:
            why = pin_host_memory(self.flat)
            self.pinned = why is None
            if self.pinned:  # unregister before the memory is freed, even without close()
                self._unpin = weakref.finalize(self, unpin_host_memory, self.flat)
                self._unpin.atexit = False  # at exit the CUDA context may already be gone
            if why is not None:
                limit = memlock_limit_bytes()
                log.warning(
                    "TokenCake: could not pin the %s GiB host pool (%s; RLIMIT_MEMLOCK %s); using "
                    "pageable memory: copies work but are slower",
                    _gib(total),
                    why,
                    "unlimited" if limit is None else f"{limit} bytes",
                )
        self.parts: list[Part] = []
        self.tensors: list[torch.Tensor] = []
        for view, perm, outer, pv, offset in plans:
            outer_shape, inner_shape = tuple(pv.shape[1 : 1 + outer]), tuple(pv.shape[1 + outer :])
            count = num_host * math.prod(pv.shape[1:])
            raw = self.flat[offset : offset + count * view.element_size()]
            mem = raw.view(view.dtype).view(*outer_shape, num_host, *inner_shape)
            # The same memory in the device view's logical dim order (tests and tools read it).
            inverse = [perm.index(d) for d in range(len(perm))]
            self.tensors.append(mem.movedim(outer, 0).permute(inverse))
            for idx in itertools.product(*(range(n) for n in outer_shape)):
                dev = pv[(slice(None), *idx)]
                host = mem[idx] if idx else mem
                nbytes = math.prod(inner_shape) * view.element_size()
                self.parts.append(Part(dev, host, nbytes, is_dense(dev)))

    def close(self) -> None:
        """Unpin the buffer (it stays valid as pageable memory until dropped)."""
        if self.pinned:
            self.pinned = False
            self._unpin()


__all__ = [
    "HOST_ALIGN",
    "HostBuffer",
    "HostMemoryError",
    "Part",
    "available_ram_bytes",
    "check_host_memory",
    "memlock_limit_bytes",
    "pin_host_memory",
    "populated_host_buffer",
    "unpin_host_memory",
]
