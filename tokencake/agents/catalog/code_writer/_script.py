"""code-writer's scripted model: deterministic replies that solve the default task (a range toolkit)."""

from __future__ import annotations

import re

import tokencake as tc

SOLUTION = {
    1: (
        "ranges_parse.py",
        '''"""Parse range lists such as '1-3, 7'."""


def parse_ranges(text):
    """Return sorted (start, end) tuples; raise ValueError on bad items."""
    ranges = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        start, sep, end = item.partition("-")
        try:
            lo = int(start)
            hi = int(end) if sep else lo
        except ValueError:
            raise ValueError(f"bad range {item!r}") from None
        if hi < lo:
            raise ValueError(f"range {item!r} ends before it starts")
        ranges.append((lo, hi))
    return sorted(ranges)
''',
        """from ranges_parse import parse_ranges


def test_single_and_pairs():
    assert parse_ranges("5, 1-3") == [(1, 3), (5, 5)]


def test_blank_items_are_ignored():
    assert parse_ranges(" 2-4 ,, ") == [(2, 4)]


def test_bad_item_raises():
    for text in ["x-2", "5-1"]:
        try:
            parse_ranges(text)
        except ValueError:
            continue
        assert False, f"expected ValueError for {text!r}"
""",
    ),
    2: (
        "ranges_merge.py",
        '''"""Merge overlapping ranges and measure coverage."""


def merge_ranges(ranges):
    """Merge overlapping or touching (start, end) ranges; returns a sorted list."""
    merged = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def coverage(ranges):
    """Number of integers covered by the ranges, overlaps counted once."""
    return sum(hi - lo + 1 for lo, hi in merge_ranges(ranges))
''',
        """from ranges_merge import coverage, merge_ranges


def test_merge_overlapping_and_touching():
    assert merge_ranges([(9, 9), (1, 3), (7, 8), (2, 4)]) == [(1, 4), (7, 9)]


def test_merge_empty():
    assert merge_ranges([]) == []


def test_coverage_counts_overlaps_once():
    assert coverage([(1, 3), (2, 4), (7, 9)]) == 7
""",
    ),
    3: (
        "ranges_report.py",
        '''"""Format ranges as a short coverage report."""


def format_ranges(ranges):
    """'1-3, 5' style text for (start, end) tuples."""
    return ", ".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in ranges)


def format_report(ranges, total):
    """One line: the ranges and the share of `total` they cover."""
    covered = sum(hi - lo + 1 for lo, hi in ranges)
    share = covered / total if total else 0.0
    return f"{format_ranges(ranges)} covers {covered} of {total} ({share:.0%})"
''',
        """from ranges_report import format_ranges, format_report


def test_format_ranges():
    assert format_ranges([(1, 3), (5, 5)]) == "1-3, 5"


def test_format_report():
    assert format_report([(1, 3), (5, 5)], 8) == "1-3, 5 covers 4 of 8 (50%)"


def test_zero_total():
    assert format_report([], 0) == " covers 0 of 0 (0%)"
""",
    ),
}

_REVISION = (
    "ranges_report.py",
    '''"""Format ranges as a short coverage report."""


def format_ranges(ranges):
    """'1-3, 5' style text for (start, end) tuples."""
    return ", ".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in ranges)


def format_report(ranges, total):
    """One line: the ranges and the share of `total` they cover."""
    if total < 0:
        raise ValueError("total must not be negative")
    covered = sum(hi - lo + 1 for lo, hi in ranges)
    share = covered / total if total else 0.0
    return f"{format_ranges(ranges)} covers {covered} of {total} ({share:.0%})"
''',
    "test_ranges_report.py",
    """from ranges_report import format_ranges, format_report


def test_format_ranges():
    assert format_ranges([(1, 3), (5, 5)]) == "1-3, 5"


def test_format_report():
    assert format_report([(1, 3), (5, 5)], 8) == "1-3, 5 covers 4 of 8 (50%)"


def test_zero_total():
    assert format_report([], 0) == " covers 0 of 0 (0%)"


def test_negative_total_raises():
    try:
        format_report([(1, 2)], -1)
    except ValueError:
        return
    assert False, "expected ValueError"
""",
)

_DESIGN = (
    "1. ranges_parse.py: parse_ranges(text) turns '1-3, 5' into sorted (start, end) tuples.\n"
    "2. ranges_merge.py: merge_ranges(ranges) merges overlaps; coverage(ranges) counts integers.\n"
    "3. ranges_report.py: format_report(ranges, total) writes a one-line coverage report.\n"
    "Each module is standalone and has a test_ module with plain asserts."
)


def _files_reply(*pairs: str) -> str:
    return "\n\n".join(
        f"# file: {path}\n```python\n{code}```" for path, code in zip(pairs[::2], pairs[1::2], strict=True)
    )


def _solution_reply(k: int) -> str:
    module, code, tests = SOLUTION[k]
    return _files_reply(module, code, f"test_{module}", tests)


def script(request: tc.ScriptedRequest) -> str:
    """Deterministic replies that solve :data:`DEFAULT_TASK` (used by ``--scripted`` and the tests)."""
    node = request.node
    if node.startswith("architect_"):
        return _DESIGN
    if node.startswith("search_"):
        return "merge overlapping intervals parse ranges python testing"
    if node.startswith("judger_"):
        return "APPROVE: the design separates parsing, merging and reporting, and every module has tests."
    if node == "file_write_plan":
        return "\n".join(
            line.split(":")[0] + ": " + line.split(":", 1)[1].strip() for line in _DESIGN.splitlines()[:3]
        )
    match = re.fullmatch(r"programmer_(\d)_(validate_patch|repair)", node)
    if match:
        k = int(match.group(1))
        if match.group(2) == "repair" and "passed validation" in request.prompt:
            return "No remaining risk: the tests cover normal input, blanks and errors."
        return _solution_reply(k)
    if node.startswith("code_write_"):
        return f"Add the module and tests of part {node.rsplit('_', 1)[1]}."
    if node == "reviewer_1":
        return (
            "format_report accepts a negative total and prints a negative share; it should raise ValueError."
        )
    if node == "reviewer_2":
        return "Tests cover normal input, blank items, errors and empty input. Looks good."
    if node == "reviser_1_validate_patch":
        return _files_reply(*_REVISION)
    if node.startswith("reviser_"):
        return "NO CHANGES" if node == "reviser_2_validate_patch" else "Nothing else to change."
    if node.startswith("revised_code_write_"):
        return "Reject negative totals in format_report." if node.endswith("1") else "No revision needed."
    if node == "external_eval":
        return "Check that every module compiles, has docstrings and is covered by tests."
    if node == "user_confirm":
        return (
            "Added ranges_parse, ranges_merge and ranges_report with tests; format_report now rejects "
            "negative totals. All validations passed."
        )
    if node == "test_node":
        return "Run every test_*.py after the style and compile checks."
    return "OK"
