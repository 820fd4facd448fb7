"""Reading vLLM's log: its tail, and the root cause and fix of a failed start in one line.

vLLM reports a failed start as a long traceback (EngineCore's, then the API server's wrapper);
``startup_error_message`` turns it into ``vLLM exited with code RC while starting: CAUSE — fix:
HINT``, the line ``tokencake serve`` prints.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def read_tail(path: Path | None, lines: int = 20) -> str:
    """The last ``lines`` lines of the file at ``path`` (its last 64 KiB); "" when unreadable."""
    if path is None:
        return ""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def last_line(path: Path | None) -> str:
    """The last line of the file at ``path``, stripped ("" when unreadable)."""
    text = read_tail(path, 1)
    return text.strip()


#: vLLM's log prefix: ``(EngineCore pid=12) ERROR 12-01 10:00:00 [core.py:1510] `` (each part optional).
_LEVEL = r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s?"
_LOG_PREFIX = re.compile(rf"^(?:\S*\((?:[\w\-.: ]+?) pid=\d+\)\s*)?(?:{_LEVEL})?")
#: The last line of a traceback: ``ValueError: …`` / ``torch.OutOfMemoryError: …`` at column 0.
_EXCEPTION_LINE = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Failure|Interrupt))(?::\s*(?P<msg>.*))?$"
)
#: Wrappers that only point at the real cause printed before them.
_WRAPPERS = (
    "Engine core initialization failed",
    "Frontend process failed during engine core initialization",
    "See root cause above",
)
#: ERROR log lines that belong to a traceback's layout, not to its message.
_NOT_A_CAUSE = ("Traceback", "EngineCore failed to start", "The above exception", "During handling")
_MAX_CAUSE_CHARS = 400


def _strip_log_prefix(line: str) -> str:
    line = line.rstrip("\r\n")
    match = _LOG_PREFIX.match(line)
    return line[match.end() :] if match else line


def startup_cause(log_text: str) -> str:
    """The root cause of a failed vLLM start, from its log: one line, or "" when none is found.

    vLLM prints the real error inside EngineCore's traceback and then the API server's wrapper
    (``RuntimeError: Engine core initialization failed. See root cause above``); the frames in
    between (``File …`` and source lines such as ``raise RuntimeError(``) are never the answer.
    The last exception line that is not a wrapper wins; else the last ``ERROR`` log message.
    """
    cause = ""
    error_message = ""
    lines = [(" ERROR " in raw[:120], _strip_log_prefix(raw)) for raw in log_text.splitlines()]
    for i, (is_error, line) in enumerate(lines):
        if not line or line[0].isspace():  # traceback frames and source lines are indented
            continue
        match = _EXCEPTION_LINE.match(line)
        if match is not None:
            if match.group("type") in ("SystemExit", "KeyboardInterrupt"):
                continue
            if any(w in line for w in _WRAPPERS):
                continue
            cause = line
            if "validation error" in line:  # pydantic: the reason is on the next, indented line
                detail = next((d.strip() for _, d in lines[i + 1 : i + 4] if d.strip()), "")
                cause += f": {detail.split(' [type=', 1)[0]}" if detail else ""
        elif is_error and not line.startswith(_NOT_A_CAUSE) and not any(w in line for w in _WRAPPERS):
            error_message = line
    found = cause or error_message
    return found[:_MAX_CAUSE_CHARS] + ("…" if len(found) > _MAX_CAUSE_CHARS else "")


def startup_hint(cause: str) -> str:
    """The ``tokencake serve`` fix for a known start-up failure, or ""."""
    text = cause.lower()
    if "max seq len" in text or "kv cache is needed" in text or "no available memory for the cache" in text:
        estimate = re.search(r"estimated maximum model length is (\d+)", cause)
        fits = f" (about {estimate.group(1)} fits)" if estimate else ""
        return (
            f"the KV cache cannot hold one request of --max-model-len: lower --max-model-len{fits} "
            "or give more KV with --num-gpu-blocks / --kv-cache-gib"
        )
    if "address already in use" in text:
        return "a port is taken: pick another --port (the events port is --port + 1, or --events-port)"
    if "out of memory" in text or "available memory on node" in text:
        return "not enough memory: lower --kv-cache-gib / --num-gpu-blocks or --host-pool-gib"
    return ""


def _short_cause(cause: str, hint: str) -> str:
    """vLLM's own advice names engine arguments; with our hint, keep only its diagnosis."""
    if hint:
        for marker in (" Try increasing", " Try decreasing", " See https://"):
            cut = cause.find(marker)
            if cut > 0:
                cause = cause[:cut]
    return cause.rstrip()


def startup_error_message(rc: int, log_text: str, log_path: Path | None = None) -> str:
    """``vLLM exited with code RC while starting: CAUSE — fix: HINT`` in one line."""
    cause = startup_cause(log_text)
    msg = f"vLLM exited with code {rc} while starting"
    if not cause:
        return msg + (f" (log: {log_path})" if log_path else "")
    hint = startup_hint(cause)
    msg += f": {_short_cause(cause, hint)}"
    return msg + (f" — fix: {hint}" if hint else "")


__all__ = ["last_line", "read_tail", "startup_cause", "startup_error_message", "startup_hint"]
