"""Copy planning (pure Python): run grouping, staging decisions, chunks, CPU gathers."""

from __future__ import annotations

import pytest

from tokencake.serving.vllm._copy_plan import (
    StagedChunk,
    gather_into_host,
    host_runs,
    runs,
    staged_chunks,
    use_staging,
)


def test_runs_group_consecutive_pairs() -> None:
    assert runs([3, 4, 5, 9], [0, 1, 2, 3]) == [(3, 0, 3), (9, 3, 1)]
    assert runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]
    assert runs([], []) == []
    with pytest.raises(ValueError):
        runs([1], [])


def test_host_runs_are_offset_slot_length() -> None:
    assert host_runs([4, 5, 6, 0, 1, 9]) == [(0, 4, 3), (3, 0, 2), (5, 9, 1)]
    assert host_runs([]) == []
    assert host_runs([3, 3]) == [(0, 3, 1), (1, 3, 1)]


def test_use_staging_only_when_it_saves_copies() -> None:
    assert not use_staging(1, 1)  # contiguous
    assert not use_staging(2, 1)  # a couple of runs: plain copies
    assert use_staging(3, 1)
    assert use_staging(64, 1)  # scattered device ids, consecutive host slots
    assert use_staging(64, 32)
    assert not use_staging(64, 33)
    assert not use_staging(64, 64)  # both sides scattered: staging saves nothing


def test_staged_chunks_split_and_offsets() -> None:
    slots = [10, 11, 12, 13, 14, 0, 1]
    assert staged_chunks(slots, 16) == [StagedChunk(0, 7, ((0, 10, 5), (5, 0, 2)))]
    assert staged_chunks(slots, 3) == [
        StagedChunk(0, 3, ((0, 10, 3),)),
        StagedChunk(3, 3, ((0, 13, 2), (2, 0, 1))),
        StagedChunk(6, 1, ((0, 1, 1),)),
    ]
    assert staged_chunks([], 4) == []
    with pytest.raises(ValueError):
        staged_chunks(slots, 0)
    # Every pair is covered exactly once, in order.
    covered = [
        (c.start + off + i, slot + i)
        for c in staged_chunks(slots, 3)
        for off, slot, n in c.host_runs
        for i in range(n)
    ]
    assert covered == list(enumerate(slots))


def test_gather_into_host_flags_scattered_host_runs() -> None:
    # host run [0..3] fed by scattered blocks; host run [7..8] fed by one device run
    assert gather_into_host([9, 2, 40, 5, 20, 21], [0, 1, 2, 3, 7, 8]) == [True, False]
    assert gather_into_host([1, 2, 3], [0, 1, 2]) == [False]
    assert gather_into_host([1, 2, 7, 8], [0, 1, 2, 3]) == [False]  # runs of two: per-run copies
    assert gather_into_host([5], [3]) == [False]
