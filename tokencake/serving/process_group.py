"""Stopping a process group for good: SIGTERM its leader, wait, SIGKILL whatever is left.

``Server`` starts the watchdog (``_watchdog.py``) as the leader of a new session, so the API
server, EngineCore and the worker all share its process group; ``tokencake stop`` and the
replicas stop a group from its recorded pgid the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO


def group_alive(pgid: int) -> bool:
    """True while process group ``pgid`` has a live (non-zombie) member."""
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text(errors="replace")
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) > 2 and fields[0] != "Z" and fields[2] == str(pgid):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(pgid: int, leader: int | None = None, *, grace: float = 30.0) -> bool:
    """SIGTERM ``leader`` (the watchdog; else the whole group), wait ``grace``, SIGKILL the rest.

    Returns True when the group is gone. Safe to call on a group that already exited.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if leader is not None:
            os.kill(leader, signal.SIGTERM)
        else:
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if leader is not None:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(leader, os.WNOHANG)  # reap if it is our child
        if not group_alive(pgid):
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if leader is not None:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(leader, os.WNOHANG)
        if not group_alive(pgid):
            return True
        time.sleep(0.05)
    return not group_alive(pgid)


def stop_child(proc: subprocess.Popen[bytes] | None, log: IO[bytes] | None, *, grace: float) -> None:
    """Stop a watchdog-led child started in its own process group, reap it, close its log file.

    Either argument may be None (nothing started, or already stopped): safe to call twice.
    """
    if proc is not None:
        stop_process_group(proc.pid, proc.pid, grace=grace)
        with contextlib.suppress(Exception):
            proc.wait(timeout=1)
    if log is not None:
        with contextlib.suppress(OSError):
            log.close()


__all__ = ["group_alive", "stop_child", "stop_process_group"]
