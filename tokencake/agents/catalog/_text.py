"""Reading structure out of model text: code files, numbered lists, citations, short phrases.

Small models rarely follow a format exactly, so every parser here has a fallback and never raises:
the apps must finish (and report what went wrong) whatever the model wrote.
"""

from __future__ import annotations

import re

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_FILE_MARK = re.compile(
    r"(?:^|\n)\s*(?:#+\s*)?(?:file|path)\s*[:=]\s*`?([A-Za-z0-9_./-]+\.[A-Za-z0-9]+)`?", re.I
)
_PY_PATH = re.compile(r"\b([A-Za-z_][A-Za-z0-9_/]*\.py)\b")
_CITE = re.compile(r"\[([a-z0-9][a-z0-9-]{1,60})\]")


def extract_files(text: str, allowed: list[str] | None = None, default: str | None = None) -> dict[str, str]:
    """Files written as ``# file: path`` followed by a fenced block (the usual prompt format).

    ``allowed`` restricts the paths (others are dropped, so an agent cannot overwrite a file it
    does not own); a fenced block with no file mark goes to the next unused allowed path, and with
    no fences at all the whole reply goes to ``default`` — writing garbage is fine, the tests will
    say so.
    """
    files: dict[str, str] = {}
    pending: list[str] = []
    pos = 0
    for match in _FENCE.finditer(text or ""):
        before = text[pos : match.start()]
        marks = _FILE_MARK.findall(before)
        code = match.group(2)
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        inner = _FILE_MARK.match("\n" + first)
        if marks:
            path = marks[-1]
        elif inner:
            path = inner.group(1)
        else:
            path = ""
        pos = match.end()
        if path:
            files[path.removeprefix("./")] = _ensure_newline(code)
        else:
            pending.append(_ensure_newline(code))
    if allowed is not None:
        files = {p: c for p, c in files.items() if p in allowed}
        free = [p for p in allowed if p not in files]
        for code, path in zip(pending, free, strict=False):
            files[path] = code
    if not files and default is not None and (text or "").strip():
        body = pending[0] if pending else text
        files[default] = _ensure_newline(body)
    return files


def _ensure_newline(code: str) -> str:
    return code if code.endswith("\n") else code + "\n"


def format_files(files: dict[str, str], max_chars: int = 1500, max_total: int = 4000) -> str:
    """Files in the same ``# file:`` + fence format the prompts ask for.

    Each file is cut at ``max_chars`` and the whole listing at about ``max_total`` characters, so
    prompts stay inside a small model's context whatever the model wrote before.
    """
    parts = []
    used = 0
    for path, code in files.items():
        room = min(max_chars, max_total - used)
        if room <= 0:
            parts.append(f"# ({len(files) - len(parts)} more files not shown)")
            break
        body = code if len(code) <= room else code[:room] + "\n# ... truncated\n"
        used += len(body)
        parts.append(f"# file: {path}\n```python\n{body.rstrip()}\n```")
    return "\n\n".join(parts)


def numbered_lines(text: str, limit: int) -> list[str]:
    """Items of a list answer (``1. x``, ``- x`` or plain lines), at most ``limit``."""
    items = []
    for line in (text or "").splitlines():
        item = re.sub(r"^\s*(?:[-*•]|\d+[.)]|[A-Za-z][.)])\s+", "", line).strip()
        if len(item) >= 3 and any(ch.isalpha() for ch in item):
            items.append(item)
    return items[:limit]


def python_paths(text: str) -> list[str]:
    """``.py`` paths mentioned in ``text``, in order, without duplicates."""
    return list(dict.fromkeys(_PY_PATH.findall(text or "")))


def citations(text: str) -> list[str]:
    """Ids cited as ``[doc-id]``, in order, without duplicates."""
    return list(dict.fromkeys(_CITE.findall(text or "")))


def one_line(text: str, max_chars: int = 200) -> str:
    """First non-empty line without markdown decoration, shortened."""
    for line in (text or "").splitlines():
        line = line.strip().strip("`*#>\"' ").strip()
        if line:
            return line[:max_chars]
    return ""


def clip(text: str, max_chars: int) -> str:
    text = text or ""
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


__all__ = ["citations", "clip", "extract_files", "format_files", "numbered_lines", "one_line", "python_paths"]
