"""The watchdog on its own: a crashed command's exit code survives the cleanup of stragglers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tokencake.serving.process_group import group_alive

# Leaves a SIGTERM-ignoring "EngineCore" behind, then exits with code 3 (a crash).
CRASH = (
    "import subprocess, sys; "
    "subprocess.Popen([sys.executable, '-c', "
    "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)']); "
    "import time; time.sleep(0.5); sys.exit(3)"
)


def _watchdog(*cmd: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tokencake.serving._watchdog", "--grace", "1", "--", *cmd],
        start_new_session=True,
        cwd=os.getcwd(),
    )


def test_a_crash_is_reported_with_the_commands_code_and_nothing_is_left() -> None:
    """A supervisor reports why a replica died: the watchdog must not SIGKILL itself with the
    stragglers (its exit code would read -9 whatever vLLM's was)."""
    proc = _watchdog(sys.executable, "-c", CRASH)
    assert proc.wait(30) == 3
    deadline = time.monotonic() + 5
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(proc.pid)  # the SIGTERM-ignoring grandchild is gone too


def test_a_command_killed_by_a_signal_reads_128_plus_the_signal() -> None:
    proc = _watchdog(sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.wait(30) == 128 + signal.SIGKILL
