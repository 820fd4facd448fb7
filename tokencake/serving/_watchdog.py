"""A tiny supervisor between its owner and a server process, so that nothing outlives the owner.

``python -m tokencake.serving._watchdog --parent PID --grace S -- CMD...`` runs CMD as its child
inside its own session (started with ``start_new_session=True``). ``Server`` starts vLLM under it
(the watchdog, the API server, EngineCore and the worker share one process group), ``Router``
starts vllm-router the same way. It then:

- forwards SIGTERM/SIGINT/SIGHUP to CMD (vLLM shuts EngineCore down itself), waits ``grace``
  seconds and SIGKILLs whatever is left of the group;
- polls its parent: when the owner dies — even by SIGKILL, where no cleanup code runs — it does
  the same shutdown. Polling ``getppid`` works from any thread of the owner, unlike
  ``PR_SET_PDEATHSIG``, which fires when the *thread* that forked exits;
- when CMD exits by itself (a crash), kills the rest of the group and exits with CMD's code
  (128 + N for a signal N), which its owner reports (a supervisor's ``last_exit``).

Stragglers get SIGKILL one by one, so that the watchdog outlives them and its exit code is CMD's;
only if they keep reappearing is the whole group, the watchdog included, killed.

Standard library only; it must start fast and never import vLLM.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

_POLL_S = 0.2


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _others(pgid: int, me: int) -> list[int]:
    """The non-zombie processes other than ``me`` in group ``pgid`` (Linux /proc)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        # fields[0] = state, fields[2] = pgrp (see proc(5)).
        if len(fields) > 2 and fields[0] != "Z" and fields[2] == str(pgid):
            found.append(int(name))
    return found


def _shutdown(child: subprocess.Popen[bytes], grace: float) -> None:
    pgid = os.getpgid(0)
    if child.poll() is None:
        try:
            child.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if child.poll() is not None and not _others(pgid, os.getpid()):
            return
        time.sleep(_POLL_S)
    # Stragglers (an EngineCore whose parent vanished, a stuck worker): no more patience.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        stragglers = _others(pgid, os.getpid())
        if not stragglers and child.poll() is not None:
            return
        for pid in stragglers:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        child.poll()  # reap CMD once it is dead
        time.sleep(0.05)
    _kill_group(pgid, signal.SIGKILL)  # they keep coming: the group goes, us included


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokencake.serving._watchdog")
    parser.add_argument("--parent", type=int, default=0, help="owner pid to watch (0: none)")
    parser.add_argument("--grace", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given")

    stop_requested = False

    def _on_signal(_signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)

    child = subprocess.Popen(cmd)
    while True:
        if stop_requested:
            _shutdown(child, args.grace)
            break
        if args.parent and os.getppid() != args.parent:
            print("tokencake watchdog: owner process is gone; stopping vLLM", file=sys.stderr, flush=True)
            _shutdown(child, args.grace)
            break
        rc = child.poll()
        if rc is not None:
            # The API server is gone; do not leave an EngineCore behind.
            _shutdown(child, min(args.grace, 5.0))
            return rc if rc >= 0 else 128 - rc
        time.sleep(_POLL_S)
    rc = child.poll()
    return 0 if rc is None else (rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    sys.exit(main())
