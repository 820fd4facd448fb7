"""Machine probes: native bf16 from the CPU flags, importable modules, and free port pairs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokencake.events import EVENTS_PORT_OFFSET
from tokencake.serving import machine
from tokencake.serving.machine import cpu_has_bf16, find_free_port, module_installed, port_is_free


def test_cpu_bf16_detection_reads_cpu_flags() -> None:
    assert cpu_has_bf16("processor : 0\nflags : fpu sse avx2 avx512f avx512_bf16\n")
    assert cpu_has_bf16("flags\t\t: fpu amx_bf16 amx_tile\n")
    assert not cpu_has_bf16("flags : fpu sse avx2 fma\n")
    assert cpu_has_bf16("no flags line at all")  # unknown: keep vLLM's default dtype


def test_cpu_bf16_detection_reads_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(machine, "CPUINFO", cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    assert not cpu_has_bf16()
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu_has_bf16()
    cpuinfo.unlink()
    assert cpu_has_bf16()  # unreadable: keep vLLM's default dtype


def test_module_installed() -> None:
    assert module_installed("json")
    assert not module_installed("tokencake_no_such_module")
    assert not module_installed("json.no_such_submodule")


def test_find_free_port_pair() -> None:
    port = find_free_port()
    assert port_is_free("127.0.0.1", port)
    assert port_is_free("127.0.0.1", port + EVENTS_PORT_OFFSET)
