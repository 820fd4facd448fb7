"""The host pool's memory: exact size, RAM check, populated pages, pinning and its fallback."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tokencake.serving.vllm import _host_memory  # noqa: E402
from tokencake.serving.vllm._copy import BlockCopier  # noqa: E402
from tokencake.serving.vllm._host_memory import HostMemoryError, check_host_memory  # noqa: E402


def _caches() -> dict[str, torch.Tensor]:
    """Three blocks-first bf16 layers of 12 blocks (1 KiB per block per layer)."""
    gen = torch.Generator().manual_seed(7)
    return {f"layer.{i}": torch.randn((12, 2, 16, 8), generator=gen).to(torch.bfloat16) for i in range(3)}


def test_host_pool_is_allocated_exactly() -> None:
    """No power-of-two rounding: 5 slots of 3 layers take 3 x 5 blocks (plus alignment)."""
    layer_bytes = 2 * 16 * 8 * 2
    copier = BlockCopier(_caches(), num_device_blocks=12, num_host_blocks=5)
    per_layer = -(-5 * layer_bytes // _host_memory.HOST_ALIGN) * _host_memory.HOST_ALIGN
    assert copier.host_nbytes == 3 * per_layer
    assert copier.host_nbytes < 2 ** (copier.host_nbytes - 1).bit_length()


# ------------------------------------------------------------------ host memory checks


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MAP_POPULATE"), reason="MAP_POPULATE is Linux-only")
def test_host_pool_pages_are_backed_when_it_is_allocated() -> None:
    """Not at the first offload into them: on a lazily backed VM a first write to a page is a fault
    the hypervisor serves (offloads ran ~50 x slower into a fresh pool)."""
    nbytes = 48 << 20
    before = _resident_bytes()
    buf = _host_memory.populated_host_buffer(nbytes)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes and buf.is_contiguous()
    assert _resident_bytes() - before >= 0.9 * nbytes  # resident now, before anything is written
    assert int(buf[:4096].sum()) == 0  # anonymous memory: zeros
    buf[nbytes - 1] = 7
    assert int(buf[nbytes - 1]) == 7
    # The copier's pool is such a buffer (a 40-slot pool of 3 layers of 4 KiB blocks).
    before = _resident_bytes()
    caches = {f"layer.{i}": torch.zeros(4, 2, 256, 4) for i in range(3)}  # 8 KiB per block per layer
    copier = BlockCopier(caches, num_device_blocks=4, num_host_blocks=400)
    assert _resident_bytes() - before >= 0.9 * copier.host_nbytes
    assert copier.copy("d2h", [1, 2], [0, 399]).done()


def test_host_pool_falls_back_to_lazy_pages_where_it_cannot_map_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(_host_memory.mmap, "MAP_POPULATE", raising=False)
    buf = _host_memory.populated_host_buffer(1 << 20)
    assert buf.numel() == 1 << 20 and buf.dtype == torch.uint8
    assert _host_memory.populated_host_buffer(0).numel() == 0


def test_host_memory_check_refuses_a_pool_larger_than_free_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    check_host_memory(8 << 30, None)  # unknown: allowed
    check_host_memory(8 << 30, 10 << 30)
    with pytest.raises(HostMemoryError) as err:
        check_host_memory(40 << 30, 31 << 30)
    msg = str(err.value)
    assert "\n" not in msg and "--host-pool-gib" in msg and "40.0 GiB" in msg and "27.9" in msg
    monkeypatch.setattr(_host_memory, "available_ram_bytes", lambda: 1000)
    with pytest.raises(HostMemoryError):
        BlockCopier(_caches(), num_device_blocks=12, num_host_blocks=5)
    BlockCopier(_caches(), 12, 5, check_ram=False)  # tools may skip the check


def test_available_ram_is_known_on_linux() -> None:
    avail = _host_memory.available_ram_bytes()
    assert avail is None or avail > 0


def test_failed_pinning_falls_back_to_pageable_memory(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_host_memory, "pin_host_memory", lambda t: "cudaHostRegister returned error 2")
    with caplog.at_level("WARNING", logger="vllm.tokencake.copy"):
        copier = BlockCopier(_caches(), 12, 4, pin=True)
    assert not copier.pinned
    (rec,) = caplog.records
    assert "could not pin" in rec.getMessage() and "RLIMIT_MEMLOCK" in rec.getMessage()
    assert copier.copy("d2h", [1, 2], [0, 1]).done()  # still copies


def test_pinned_pool_is_unpinned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    unpinned: list[int] = []
    monkeypatch.setattr(_host_memory, "pin_host_memory", lambda t: None)
    monkeypatch.setattr(_host_memory, "unpin_host_memory", lambda t: unpinned.append(t.data_ptr()))
    copier = BlockCopier(_caches(), 12, 4, pin=True)
    assert copier.pinned
    copier.close()
    copier.close()
    assert unpinned == [copier._host.flat.data_ptr()]


def test_pin_without_cuda_reports_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert _host_memory.pin_host_memory(torch.empty(16, dtype=torch.uint8))
