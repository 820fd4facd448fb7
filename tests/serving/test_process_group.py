"""stop_child: a child led in its own process group is stopped, reaped and its log closed, once."""

from __future__ import annotations

import subprocess
import sys

from tokencake.serving.process_group import group_alive, stop_child


def test_stop_child_stops_the_group_and_closes_the_log(tmp_path) -> None:
    log = (tmp_path / "child.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], stdout=log, start_new_session=True
    )
    assert group_alive(proc.pid)
    stop_child(proc, log, grace=5.0)
    assert proc.returncode is not None
    assert not group_alive(proc.pid)
    assert log.closed


def test_stop_child_with_nothing_started_is_a_no_op() -> None:
    stop_child(None, None, grace=0.1)
