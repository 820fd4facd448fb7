"""Which copy calls move a list of block pairs (pure Python: no torch, no vLLM).

A copy is two equal-length lists: ``device_blocks[i]`` pairs with ``host_slots[i]``. Pairs
whose ids both increase by one form a run, copied with one call (:func:`runs`). Scattered ids
go through a staging buffer when that saves calls (:func:`use_staging`), in chunks the buffer
holds (:func:`staged_chunks`); on CPU, D2H gathers scattered blocks straight into the host
slots instead (:func:`gather_into_host`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise


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


__all__ = [
    "StagedChunk",
    "gather_into_host",
    "host_runs",
    "runs",
    "staged_chunks",
    "use_staging",
]
