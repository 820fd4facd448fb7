"""``KVCore.handle_event``: the stalls transparent mode derived are counted apart."""

from __future__ import annotations

import time

from tokencake.events import StallBegin, StallEnd
from tokencake.serving.kvcore.core import KVCore
from tokencake.serving.transparent import TRANSPARENT_NODE


def _begin(stall_id: str, node: str) -> StallBegin:
    return StallBegin(
        stall_id=stall_id, session_id=f"s-{stall_id}", run_id="r", node=node, tool="t", ts=time.time()
    )


def _end(stall_id: str, node: str) -> StallEnd:
    return StallEnd(
        stall_id=stall_id,
        session_id=f"s-{stall_id}",
        run_id="r",
        node=node,
        tool="t",
        duration_s=0.1,
        ts=time.time(),
    )


def test_transparent_stalls_are_counted_once_each() -> None:
    core = KVCore(block_size=4, block_bytes=1024, num_host_blocks=8)
    assert core.handle_event(_begin("a", TRANSPARENT_NODE)).status == "recorded"
    assert core.handle_event(_begin("a", TRANSPARENT_NODE)).status == "duplicate"
    core.handle_event(_begin("sdk", "researcher"))
    assert core.handle_event(_end("a", TRANSPARENT_NODE)).status == "recorded"
    core.handle_event(_end("sdk", "researcher"))
    core.handle_event(_end("never-began", TRANSPARENT_NODE))  # rejected: not counted
    assert core.stats.counter("events.transparent_begin") == 1
    assert core.stats.counter("events.transparent_end") == 1
    assert core.stats.counter("events.stall_begin") == 3  # every event, as before
