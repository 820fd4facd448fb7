"""Numbers quoted in README and docs, generated from stored ``results.json`` files.

A quoted number is written between two markers that say where it comes from::

    <!--bench ci-pop-results.json aggregate|ci|rounds|tokencake/ideal ci3-->0.946 [0.883, 1.010]<!--/bench-->

``FILE`` is relative to ``docs/bench/``; ``PATH`` walks the JSON with ``|`` (keys may contain ``/``);
``FORMAT`` is a Python format spec (``.3f``, ``.0%``, ``,.0f``) or ``ci<d>``: a
:func:`~tokencake.bench.intervals.mean_ci` entry as ``mean [low, high]`` with d decimals, or
``ci%``: the same in whole percent, or ``pci<d>``: a paired ratio entry (``ratio`` and its bootstrap
``ci95``) as ``ratio [low, high]``. Markers are invisible in rendered Markdown.

``python -m tokencake.bench.claims --write README.md docs/*.md`` rewrites every quoted number from
its source; ``--check`` (and ``tests/docs/test_claims.py``) fails when any differs, so a number in the
docs is always the one a stored result backs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["ClaimError", "claims", "main", "render"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "docs" / "bench"
_MARK = re.compile(r"<!--bench (?P<file>\S+) (?P<path>\S+) (?P<fmt>\S+?)-->(?P<value>.*?)<!--/bench-->", re.S)

#: Where a marker starts, well formed or not: every one must parse as :data:`_MARK`.
_OPENING = re.compile(r"<!--\s*bench\s")


class ClaimError(ValueError):
    """A marker whose source is missing or whose path does not resolve."""


def _load(path: Path) -> Any:
    """The parsed file, read again when it changed (a generator may rewrite it between renders)."""
    st = path.stat()
    return _parse(path, st.st_mtime_ns, st.st_size)


@cache
def _parse(path: Path, _mtime_ns: int, _size: int) -> Any:
    return json.loads(path.read_text())


def _walk(data: Any, path: str, where: str) -> Any:
    node = data
    for part in path.split("|"):
        if isinstance(node, list) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise ClaimError(f"{where}: {path!r} does not resolve (at {part!r})")
    return node


def _interval(center: float, ci: Any, fmt: str) -> str:
    """``center [low, high]`` with ``fmt``'s decimals (``ci<d>``, ``pci<d>``) or in percent (``ci%``)."""
    lo, hi = ci or (None, None)
    if fmt.endswith("%"):
        parts = [f"{x * 100:.0f} %" if x is not None else "—" for x in (center, lo, hi)]
    else:
        d = int(fmt.lstrip("pci") or 3)
        parts = [f"{x:.{d}f}" if x is not None else "—" for x in (center, lo, hi)]
    return f"{parts[0]} [{parts[1]}, {parts[2]}]"


def _format(value: Any, fmt: str, where: str) -> str:
    if fmt.startswith("pci"):
        if not isinstance(value, dict) or value.get("ratio") is None:
            raise ClaimError(f"{where}: {fmt} needs a ratio/ci95 entry (a paired comparison)")
        return _interval(value["ratio"], value.get("ci95"), fmt)
    if fmt.startswith("ci"):
        if not isinstance(value, dict) or value.get("mean") is None:
            raise ClaimError(f"{where}: {fmt} needs a mean/ci95 entry")
        return _interval(value["mean"], value.get("ci95"), fmt)
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return str(value)
    try:
        return format(value, fmt)
    except ValueError as exc:
        raise ClaimError(f"{where}: format {fmt!r} does not apply to {value!r} ({exc})") from None


def render(text: str, results_dir: Path = RESULTS_DIR, *, where: str = "<text>") -> str:
    """``text`` with every marked number regenerated from its stored result."""

    def one(m: re.Match[str]) -> str:
        src = results_dir / m["file"]
        if not src.is_file():
            raise ClaimError(f"{where}: {m['file']} not found in {results_dir}")
        value = _format(_walk(_load(src), m["path"], where), m["fmt"], where)
        return f"<!--bench {m['file']} {m['path']} {m['fmt']}-->{value}<!--/bench-->"

    parsed = {m.start() for m in _MARK.finditer(text)}
    for opening in _OPENING.finditer(text):
        if opening.start() not in parsed:  # a marker the pattern skips would never be checked
            line = text.count("\n", 0, opening.start()) + 1
            want = "<!--bench FILE PATH FORMAT-->…<!--/bench-->"
            raise ClaimError(f"{where}:{line}: malformed marker (want {want})")
    return _MARK.sub(one, text)


def claims(text: str) -> list[tuple[str, str, str, str]]:
    """``(file, path, format, quoted value)`` of every marker in ``text``."""
    return [(m["file"], m["path"], m["fmt"], m["value"]) for m in _MARK.finditer(text)]


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokencake.bench.claims", description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the quoted numbers in place")
    mode.add_argument("--check", action="store_true", help="exit 1 when a quoted number differs (default)")
    args = p.parse_args(list(argv) if argv is not None else None)
    stale = 0
    for f in args.files:
        text = f.read_text()
        try:
            fresh = render(text, where=str(f))
        except ClaimError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if fresh != text:
            stale += 1
            if args.write:
                f.write_text(fresh)
                print(f"updated {f}")
            else:
                print(f"{f}: quoted numbers differ from their stored results", file=sys.stderr)
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    raise SystemExit(main())
