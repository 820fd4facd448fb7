"""Block copies between the device KV cache and the host pool (torch only, no vLLM).

Why a separate module: the same helpers run inside vLLM's worker process and in
``scripts/gpu_check.py`` on machines that have torch but not vLLM, so what the benchmark
measures is exactly the connector's copy path.

Layout. vLLM 0.32 hands the worker one ``[B, H, N, C]`` view per attention layer (K and V
packed in ``C``) whose strides follow the resolved KV layout: ``LBNHC`` (FlashAttention's
default) stores a block as ``[N, H, C]``, block-outer layouts (``BL…``) interleave the layers'
pages, and older layouts put K/V first (``[2, B, …]``). When the kernel block size is smaller
than the scheduler's, dim 0 counts kernel blocks, ``ratio`` per scheduler block (vLLM's own
``group_kernel_blocks`` view). The copier views each layer block-first in *memory* order and
splits off a leading K/V dim, so every part of a block is one contiguous byte range
(:func:`copy_parts`). The host pool keeps, per part, a contiguous ``[num_host_blocks, …]``
tensor: a host slot is one contiguous chunk and a run of blocks is one ``copy_``.

No hidden temporaries. A ``copy_`` between a CUDA tensor and a host tensor that is not
contiguous on both sides makes torch allocate a GPU temporary that vLLM's memory profiler
never saw. On CUDA only contiguous runs are copied directly; anything else (scattered ids,
block-outer layouts) goes through a fixed staging buffer per copy lane, allocated once at
start: D2H gathers the blocks with one ``index_select`` into it and copies it out with one copy
per *host* run; H2D copies the host runs into it and scatters with one ``index_copy_``. Large
copies go in chunks (:func:`staged_chunks`). On CPU the host tensors are directly
addressable, so D2H gathers straight into the host slots instead (measured ~1.5x faster than
per-block ``copy_`` for scattered bf16 blocks; H2D stays per run).

Host memory. The pool is one flat buffer of exactly the size asked for, checked against the
RAM this process may still use (:func:`check_host_memory`) and, on CUDA, page-locked in place
with ``cudaHostRegister``: torch's pinned allocator rounds every allocation up to a power of
two (a 40 GiB pool would lock 64 GiB). If pinning fails (locked-memory limit, driver), the
pool stays pageable with one warning: copies still work, only slower. Its pages are populated
when it is allocated (:func:`populated_host_buffer`), not at their first write: on a virtual
machine whose memory the hypervisor backs lazily a first write to a page is a fault the host
serves, and offloads into a fresh pool ran at ~0.1 GB/s against ~5 GB/s into touched pages
(measured on this project's 2-core VMs) — synchronous copies inside the engine step on CPU.

Ordering. On CPU a copy is a plain synchronous ``copy_``. On CUDA every copy runs on the
side stream of its lane: ``load`` (demand loads, highest priority) never queues behind a large
``offload`` or ``prefetch``, each of which has its own low-priority stream. A copy waits for
the compute stream first (the blocks were written by earlier forwards, or may still be read by
them); H2D records an event that the compute stream waits on before any forward that may read
the blocks (``CopyHandle.order_before_compute``) or that the worker polls (``CopyHandle.done``)
before it reports the job.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import mmap
import time
import weakref
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.tokencake.copy")

Direction = Literal["d2h", "h2d"]
#: Copy lanes, one CUDA stream (and staging buffer) each.
Lane = Literal["load", "prefetch", "offload"]
LANES: tuple[Lane, ...] = ("load", "prefetch", "offload")
#: Host pool layers start at multiples of this many bytes (DMA-friendly, any dtype fits).
HOST_ALIGN = 512
#: A leading dim with a stride above the block stride is split into parts only when it is this
#: small (K/V). Larger ones (heads in an ``LHBNC`` layout) stay whole and go through staging.
MAX_SPLIT = 2


class GeometryError(ValueError):
    """The device KV tensors have no block layout this copier can map to scheduler blocks."""


class HostMemoryError(RuntimeError):
    """The host pool does not fit in the RAM this process may still use."""


class CopySubmitError(RuntimeError):
    """A copy failed after part of it was submitted; ``handle`` completes when that part has run."""

    def __init__(self, message: str, handle: CopyHandle) -> None:
        super().__init__(message)
        self.handle = handle


def block_geometry(shape: Sequence[int], num_blocks: int) -> tuple[int, int]:
    """``(block_dim, ratio)`` of a KV tensor for ``num_blocks`` scheduler blocks.

    ``block_dim`` is 0 for vLLM 0.32's ``[B, H, N, C]`` views and 1 for a K/V-first
    ``[2, B, ...]`` tensor. ``ratio`` is the number of kernel blocks per scheduler block (the
    size of ``block_dim`` is ``ratio * num_blocks``; 1 when the block sizes agree). Raises
    :class:`GeometryError` when neither dim fits.
    """
    if num_blocks <= 0:
        raise GeometryError(f"num_blocks must be > 0, got {num_blocks}")
    dims = [0] + ([1] if len(shape) > 1 and shape[0] == 2 else [])
    for dim in dims:
        if shape and shape[dim] == num_blocks:
            return dim, 1
    for dim in dims:
        if shape and shape[dim] > num_blocks and shape[dim] % num_blocks == 0:
            return dim, shape[dim] // num_blocks
    raise GeometryError(
        f"no dimension of size {num_blocks} (num blocks) or a multiple of it (kernel blocks) "
        f"in KV shape {tuple(shape)}"
    )


def find_block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """Index of the block dimension of a KV tensor (see :func:`block_geometry`)."""
    return block_geometry(shape, num_blocks)[0]


def block_view(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``t`` viewed ``[num_blocks, ...]``: block dim first, kernel blocks grouped per block."""
    dim, ratio = block_geometry(t.shape, num_blocks)
    view = t.movedim(dim, 0) if dim else t
    if ratio > 1:  # kernel block j of block b is row b * ratio + j (uniformly strided: a view)
        view = view.unflatten(0, (num_blocks, ratio))
    return view


def memory_order(view: torch.Tensor) -> list[int]:
    """Dim permutation of a block-first view: dim 0, then the others by decreasing stride."""
    rest = sorted(
        range(1, view.dim()),
        key=lambda d: view.stride(d) if view.shape[d] > 1 else -1,
        reverse=True,
    )
    return [0, *rest]


def copy_parts(view: torch.Tensor) -> tuple[list[int], int]:
    """``(perm, num_outer)``: how to split a block-first view into dense parts.

    ``view.permute(perm)`` puts the dims in memory order. Its first ``num_outer`` dims after
    the block dim have strides above the block stride (a K/V dim in front of the blocks): a
    block cannot be one byte range across them, so each of their indices is its own part (a K
    half and a V half). Only splits into at most :data:`MAX_SPLIT` parts are made.
    """
    perm = memory_order(view)
    pv = view.permute(perm)
    outer = 0
    while outer + 1 < pv.dim() and pv.shape[outer + 1] > 1 and pv.stride(outer + 1) > pv.stride(0):
        outer += 1
    if math.prod(pv.shape[1 : 1 + outer]) > MAX_SPLIT:
        outer = 0
    return perm, outer


def is_dense(part: torch.Tensor) -> bool:
    """Whether every run of consecutive blocks of ``part`` is one contiguous byte range."""
    if part.shape[0] == 0 or not part[0].is_contiguous():
        return False
    return part.shape[0] == 1 or part.stride(0) == part[0].numel()


def runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group index pairs into maximal runs ``(src_start, dst_start, length)``.

    A run continues while both source and destination ids increase by one, so contiguous
    blocks are copied with one call.
    """
    if len(src) != len(dst):
        raise ValueError(f"copy lists differ in length: {len(src)} != {len(dst)}")
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out:
            s0, d0, n = out[-1]
            if s == s0 + n and d == d0 + n:
                out[-1] = (s0, d0, n + 1)
                continue
        out.append((int(s), int(d), 1))
    return out


def host_runs(host_slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive host slots as ``(offset, slot_start, length)``.

    ``offset`` is the position of the run's first pair in the copy lists (equivalently in a
    staging buffer filled in list order).
    """
    out: list[tuple[int, int, int]] = []
    for i, s in enumerate(host_slots):
        if out:
            o, s0, n = out[-1]
            if s == s0 + n:
                out[-1] = (o, s0, n + 1)
                continue
        out.append((i, int(s), 1))
    return out


def use_staging(num_runs: int, num_host_runs: int) -> bool:
    """Whether gather/scatter through a staging buffer beats one copy per run.

    Staging costs one gather (or scatter) per layer plus one copy per host run; the plain path
    costs one copy per run. Worth it when there are more than a couple of runs and the host
    runs are at most half of them.
    """
    return num_runs > 2 and 2 * num_host_runs <= num_runs


@dataclass(frozen=True)
class StagedChunk:
    """One staging-buffer load: pairs ``[start, start + length)`` of the copy lists.

    ``host_runs`` are ``(staging_offset, host_slot_start, length)``: staging rows
    ``[staging_offset, staging_offset + length)`` hold host slots ``[host_slot_start, ...)``.
    Row ``i`` of the staging buffer is device block ``device_blocks[start + i]``.
    """

    start: int
    length: int
    host_runs: tuple[tuple[int, int, int], ...]


def staged_chunks(host_slots: Sequence[int], max_blocks: int) -> list[StagedChunk]:
    """Split a copy into chunks of at most ``max_blocks`` pairs, each with its host runs."""
    if max_blocks <= 0:
        raise ValueError(f"max_blocks must be > 0, got {max_blocks}")
    out: list[StagedChunk] = []
    for start in range(0, len(host_slots), max_blocks):
        part = host_slots[start : start + max_blocks]
        out.append(StagedChunk(start, len(part), tuple(host_runs(part))))
    return out


def gather_into_host(device_blocks: Sequence[int], host_slots: Sequence[int]) -> list[bool]:
    """CPU D2H: for each of ``host_runs(host_slots)``, gather it with ``index_select``?

    True when the run's device blocks form at least two runs of average length below two
    (scattered), where one ``index_select`` straight into the host slots beats per-run copies.
    """
    flags = []
    for off, _, n in host_runs(host_slots):
        ids = device_blocks[off : off + n]
        dev_runs = 1 + sum(1 for a, b in pairwise(ids) if b != a + 1)
        flags.append(dev_runs >= 2 and 2 * dev_runs > n)
    return flags


# ------------------------------------------------------------------ host memory


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


# ------------------------------------------------------------------ copies


@dataclass
class CopyHandle:
    """One submitted copy. On CPU it is complete on return; on CUDA poll ``done()``."""

    direction: Direction
    num_blocks: int
    nbytes: int
    started: float
    lane: Lane = "offload"
    _event_start: Any = None
    _event_end: Any = None
    _seconds: float | None = None
    error: str | None = None
    _extra: dict[str, Any] = field(default_factory=dict)

    def done(self) -> bool:
        """True once the data has arrived (always true on CPU)."""
        if self._event_end is None:
            return True
        return bool(self._event_end.query())

    def wait(self) -> None:
        """Block the calling thread until the copy finished."""
        if self._event_end is not None:
            self._event_end.synchronize()

    def order_before_compute(self) -> None:
        """Make the current (compute) stream wait for this copy without blocking the host."""
        if self._event_end is not None:
            import torch

            torch.cuda.current_stream().wait_event(self._event_end)

    @property
    def seconds(self) -> float:
        """Copy duration; on CUDA measured between stream events (call after ``done()``)."""
        if self._seconds is None and self._event_end is not None and self.done():
            try:
                self._seconds = self._event_start.elapsed_time(self._event_end) / 1000.0
            except Exception:  # timing is best effort: a bad event must not fail the job
                self._seconds = time.perf_counter() - self.started
        return self._seconds if self._seconds is not None else 0.0


@dataclass
class _Part:
    """One dense slice of a layer: ``dev[b]`` pairs with ``host[s]`` (both block-first)."""

    dev: torch.Tensor
    host: torch.Tensor
    #: Bytes of one block of this part.
    nbytes: int
    #: Runs of consecutive device blocks are contiguous: plain copies need no temporary.
    dense: bool


@dataclass
class _Lane:
    """A copy lane: its CUDA stream (None on CPU) and its fixed staging buffers."""

    stream: Any = None
    staging: torch.Tensor | None = None
    index: torch.Tensor | None = None


class BlockCopier:
    """Host pool storage plus the D2H / H2D block copy helpers.

    ``device_caches``: layer name -> device KV tensor (as given to ``register_kv_caches``).
    The host memory is allocated once here (exact size, pinned when the device is CUDA) and
    never grows: the pool is the pre-allocated buffer the TokenCake paper calls for.

    ``staging`` (default: on CUDA only) enables the staging-buffer path; ``staging_bytes``
    sizes each lane's buffer (copies needing more go in chunks). On CPU it exists for tests:
    the CUDA path's planning and indexing run there unchanged, synchronously.
    ``check_ram``: refuse (:class:`HostMemoryError`) a pool larger than the free RAM allows.
    """

    def __init__(
        self,
        device_caches: Mapping[str, torch.Tensor],
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        pin: bool | None = None,
        staging: bool | None = None,
        staging_bytes: int = 16 << 20,
        check_ram: bool = True,
    ) -> None:
        import torch

        if num_host_blocks <= 0:
            raise ValueError(f"num_host_blocks must be > 0, got {num_host_blocks}")
        if not device_caches:
            raise ValueError("no KV cache tensors to copy")
        self._torch = torch
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        first = next(iter(device_caches.values()))
        self.device = first.device
        self.is_cuda = first.device.type == "cuda"
        #: Plain copies made from or into a non-contiguous tensor (a GPU temporary on CUDA).
        self.noncontiguous_copies = 0
        views = self._layer_views(device_caches, num_device_blocks)
        self._alloc_host(
            views, num_host_blocks, pin=self.is_cuda if pin is None else pin, check_ram=check_ram
        )
        self.block_bytes = sum(p.nbytes for p in self._parts)
        self.staging = self.is_cuda if staging is None else staging
        #: Most blocks one staging-buffer load holds (parts reuse the buffer in turn).
        self.chunk_blocks = max(1, staging_bytes // max(p.nbytes for p in self._parts))
        self._lanes = {lane: self._make_lane(lane) for lane in LANES}

    # ---------------------------------------------------------------- setup
    @staticmethod
    def _layer_views(device_caches: Mapping[str, torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
        """One block-first view per distinct tensor (tied / KV-sharing layers are copied once)."""
        seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        views = []
        for t in device_caches.values():
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if key in seen:
                continue
            seen.add(key)
            views.append(block_view(t, num_blocks))
        return views

    def _alloc_host(self, views: list[torch.Tensor], num_host: int, *, pin: bool, check_ram: bool) -> None:
        """One flat host buffer of the exact size, carved into a contiguous tensor per part."""
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
        self._flat = populated_host_buffer(total)
        took = time.perf_counter() - started
        log.info("TokenCake: host pool of %s GiB mapped in %.1f s", _gib(total), took)
        self.pinned = False
        if pin:
            why = pin_host_memory(self._flat)
            self.pinned = why is None
            if self.pinned:  # unregister before the memory is freed, even without close()
                self._unpin = weakref.finalize(self, unpin_host_memory, self._flat)
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
        self._parts: list[_Part] = []
        self._host: list[torch.Tensor] = []
        for view, perm, outer, pv, offset in plans:
            outer_shape, inner_shape = tuple(pv.shape[1 : 1 + outer]), tuple(pv.shape[1 + outer :])
            count = num_host * math.prod(pv.shape[1:])
            raw = self._flat[offset : offset + count * view.element_size()]
            mem = raw.view(view.dtype).view(*outer_shape, num_host, *inner_shape)
            # The same memory in the device view's logical dim order (tests and tools read it).
            inverse = [perm.index(d) for d in range(len(perm))]
            self._host.append(mem.movedim(outer, 0).permute(inverse))
            for idx in itertools.product(*(range(n) for n in outer_shape)):
                dev = pv[(slice(None), *idx)]
                host = mem[idx] if idx else mem
                nbytes = math.prod(inner_shape) * view.element_size()
                self._parts.append(_Part(dev, host, nbytes, is_dense(dev)))

    def _make_lane(self, lane: Lane) -> _Lane:
        torch = self._torch
        stream = None
        if self.is_cuda:
            low, high = torch.cuda.Stream.priority_range()
            stream = torch.cuda.Stream(device=self.device, priority=high if lane == "load" else low)
        out = _Lane(stream)
        if self.staging:
            # Allocated once, on the lane's stream: the caching allocator ties the blocks to it, and
            # every user of the buffers runs on that stream (stream-ordered reuse, no record_stream).
            nbytes = self.chunk_blocks * max(p.nbytes for p in self._parts)
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                out.staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                out.index = torch.empty(self.chunk_blocks, dtype=torch.int64, device=self.device)
        return out

    # ---------------------------------------------------------------- queries
    @property
    def host_tensors(self) -> list[torch.Tensor]:
        """Per layer, the host pool viewed like the device's block-first view (tests read bytes)."""
        return self._host

    @property
    def host_nbytes(self) -> int:
        """Bytes of host memory the pool holds (exact: no power-of-two rounding)."""
        return self._flat.numel()

    @property
    def staging_nbytes(self) -> int:
        """Bytes of one lane's staging buffer (0 when staging is off)."""
        buf = self._lanes["load"].staging
        return 0 if buf is None else buf.numel()

    @property
    def dense(self) -> bool:
        """Whether every layer part copies as contiguous runs (no staging needed for the layout)."""
        return all(p.dense for p in self._parts)

    def check(self, device_blocks: Sequence[int], host_slots: Sequence[int]) -> None:
        """Raise on a bad copy (length mismatch, ids out of range) before anything is submitted."""
        if len(device_blocks) != len(host_slots):
            raise ValueError(f"copy lists differ in length: {len(device_blocks)} != {len(host_slots)}")
        for b in device_blocks:
            if not 0 <= b < self.num_device_blocks:
                raise IndexError(f"device block {b} out of range [0, {self.num_device_blocks})")
        for s in host_slots:
            if not 0 <= s < self.num_host_blocks:
                raise IndexError(f"host slot {s} out of range [0, {self.num_host_blocks})")

    # ---------------------------------------------------------------- copies
    def copy(
        self,
        direction: Direction,
        device_blocks: Sequence[int],
        host_slots: Sequence[int],
        *,
        lane: Lane | None = None,
    ) -> CopyHandle:
        """Submit one copy of whole blocks on ``lane`` (default: ``offload`` for D2H, ``load``
        for H2D). Raises on bad ids (nothing copied); :class:`CopySubmitError` if a CUDA copy
        failed after part of it was submitted."""
        self.check(device_blocks, host_slots)
        if direction == "d2h":
            plan = runs(device_blocks, host_slots)
        elif direction == "h2d":
            plan = runs(host_slots, device_blocks)
        else:
            raise ValueError(f"unknown direction {direction!r}")
        lane = lane or ("offload" if direction == "d2h" else "load")
        state = self._lanes.get(lane)
        if state is None:
            raise ValueError(f"unknown copy lane {lane!r}")
        n = len(device_blocks)
        handle = CopyHandle(direction, n, n * self.block_bytes, time.perf_counter(), lane)
        staged = self.staging and use_staging(len(plan), len(host_runs(host_slots)))
        handle._extra["staged"] = staged
        if state.stream is None:
            self._submit(direction, device_blocks, host_slots, plan, staged, state, non_blocking=False)
            handle._seconds = time.perf_counter() - handle.started
            return handle
        torch = self._torch
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(state.stream):
            # Earlier forwards wrote (D2H) or may still read the destination (H2D): order after them.
            state.stream.wait_stream(compute)
            start.record(state.stream)
            try:
                self._submit(direction, device_blocks, host_slots, plan, staged, state, non_blocking=True)
            except Exception as exc:
                # Part of the copy may be queued: its end event tells when it can no longer write.
                end.record(state.stream)
                handle._event_start, handle._event_end = start, end
                raise CopySubmitError(f"{type(exc).__name__}: {exc}", handle) from exc
            end.record(state.stream)
        handle._event_start, handle._event_end = start, end
        return handle

    def _submit(
        self,
        direction: Direction,
        device_blocks: Sequence[int],
        host_slots: Sequence[int],
        plan: list[tuple[int, int, int]],
        staged: bool,
        lane: _Lane,
        *,
        non_blocking: bool,
    ) -> None:
        # With staging on, a part that is not dense always goes through the buffer: a plain copy
        # of it would make a GPU temporary per copy.
        through_buffer = [staged or (self.staging and not p.dense) for p in self._parts]
        plain = [p for p, s in zip(self._parts, through_buffer, strict=True) if not s]
        if plain:
            gathers: list[tuple[torch.Tensor, int, int]] = []
            if direction == "d2h" and not self.is_cuda:
                plan, gathers = self._cpu_gathers(device_blocks, host_slots, plan)
            self._run(direction, plain, plan, non_blocking=non_blocking, gathers=gathers)
        buffered = [p for p, s in zip(self._parts, through_buffer, strict=True) if s]
        if buffered:
            self._run_staged(direction, buffered, device_blocks, host_slots, lane, non_blocking=non_blocking)

    def _cpu_gathers(
        self,
        device_blocks: Sequence[int],
        host_slots: Sequence[int],
        plan: list[tuple[int, int, int]],
    ) -> tuple[list[tuple[int, int, int]], list[tuple[torch.Tensor, int, int]]]:
        """CPU D2H: host runs with scattered device blocks become one ``index_select`` each."""
        flags = gather_into_host(device_blocks, host_slots)
        if not any(flags):
            return plan, []
        rest: list[tuple[int, int, int]] = []
        gathers: list[tuple[torch.Tensor, int, int]] = []
        for (off, slot, n), gather in zip(host_runs(host_slots), flags, strict=True):
            ids = device_blocks[off : off + n]
            if gather:
                gathers.append((self._torch.tensor(list(ids), dtype=self._torch.int64), slot, n))
            else:
                rest.extend(runs(ids, range(slot, slot + n)))
        return rest, gathers

    def _copy_run(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        if not (dst.is_contiguous() and src.is_contiguous()):
            self.noncontiguous_copies += 1
        dst.copy_(src, non_blocking=non_blocking)

    def _run(
        self,
        direction: Direction,
        parts: list[_Part],
        plan: list[tuple[int, int, int]],
        *,
        non_blocking: bool,
        gathers: Sequence[tuple[torch.Tensor, int, int]] = (),
    ) -> None:
        torch = self._torch
        for p in parts:
            for idx, slot, n in gathers:  # CPU D2H only
                torch.index_select(p.dev, 0, idx, out=p.host[slot : slot + n])
            for a, b, n in plan:
                if direction == "d2h":
                    self._copy_run(p.host[b : b + n], p.dev[a : a + n], non_blocking)
                else:
                    self._copy_run(p.dev[b : b + n], p.host[a : a + n], non_blocking)

    def _run_staged(
        self,
        direction: Direction,
        parts: list[_Part],
        device_blocks: Sequence[int],
        host_slots: Sequence[int],
        lane: _Lane,
        *,
        non_blocking: bool,
    ) -> None:
        """Gather (D2H) / scatter (H2D) through the lane's buffer, chunk by chunk, part by part.

        One buffer serves every part in turn: all work is on the lane's stream, so a part's
        gather cannot overwrite the buffer before the previous part's copies out of it have run.
        """
        torch = self._torch
        buf, index = lane.staging, lane.index
        assert buf is not None and index is not None
        for c in staged_chunks(host_slots, self.chunk_blocks):
            # Pinned so the upload is truly async; the caching host allocator keeps the pinned
            # block alive until the copy has run.
            ids = torch.tensor(
                list(device_blocks[c.start : c.start + c.length]),
                dtype=torch.int64,
                pin_memory=non_blocking and self.is_cuda,
            )
            idx = index[: c.length]
            idx.copy_(ids, non_blocking=non_blocking)
            for p in parts:
                stage = buf[: c.length * p.nbytes].view(p.host.dtype).view(c.length, *p.host.shape[1:])
                if direction == "d2h":
                    torch.index_select(p.dev, 0, idx, out=stage)
                    for off, slot, n in c.host_runs:
                        self._copy_run(p.host[slot : slot + n], stage[off : off + n], non_blocking)
                else:
                    for off, slot, n in c.host_runs:
                        self._copy_run(stage[off : off + n], p.host[slot : slot + n], non_blocking)
                    p.dev.index_copy_(0, idx, stage)

    def close(self) -> None:
        """Unpin the host memory (the buffers stay valid as pageable memory until dropped)."""
        if self.pinned:
            self.pinned = False
            self._unpin()


__all__ = [
    "LANES",
    "BlockCopier",
    "CopyHandle",
    "CopySubmitError",
    "Direction",
    "GeometryError",
    "HostMemoryError",
    "Lane",
    "StagedChunk",
    "available_ram_bytes",
    "block_geometry",
    "block_view",
    "check_host_memory",
    "copy_parts",
    "find_block_dim",
    "gather_into_host",
    "host_runs",
    "is_dense",
    "memlock_limit_bytes",
    "memory_order",
    "pin_host_memory",
    "runs",
    "staged_chunks",
    "use_staging",
]
