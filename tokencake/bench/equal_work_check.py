"""The equal-work check: every system must have produced the same number of output tokens for every
call, or the latency comparison is meaningless."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EqualWork:
    """Outcome of comparing per-call output token counts across systems."""

    ok: bool
    calls: int
    mismatched: list[dict[str, Any]]
    missing: list[dict[str, Any]]
    prompt_mismatched: int
    text_mismatched: int
    #: Calls whose prompt token count differs although no output they could depend on differed.
    prompt_unexplained: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.ok,
            "calls_compared": self.calls,
            "output_token_mismatches": self.mismatched[:50],
            "output_token_mismatch_count": len(self.mismatched),
            "missing_calls": self.missing[:50],
            "missing_call_count": len(self.missing),
            "prompt_token_mismatch_count": self.prompt_mismatched,
            "output_text_mismatch_count": self.text_mismatched,
            "unexplained_prompt_mismatches": self.prompt_unexplained[:50],
            "unexplained_prompt_mismatch_count": len(self.prompt_unexplained),
        }


def equal_work(calls_by_system: Mapping[str, Sequence[Mapping[str, Any]]]) -> EqualWork:
    """Compare completion tokens per call key across systems.

    The check fails when any call's output token count differs, when a call exists in one system but
    not in another (a failed request, or an app that took a different path), or when a call's prompt
    token count differs *unexplained*. Greedy outputs can differ in text between systems (batching and
    cache hits change float order), and a later prompt that contains that text differs with it: a prompt
    mismatch is explained when an earlier call of the same agent session (``run/node/n``: smaller n), or
    any call of another node of the same run (a join reads the workers' outputs), had a different output
    text. Anything else means the systems were not sent the same work.
    """
    systems = list(calls_by_system)
    tables = {s: {c["key"]: c for c in calls_by_system[s]} for s in systems}
    all_keys = sorted(set().union(*(t.keys() for t in tables.values()))) if tables else []
    mismatched: list[dict[str, Any]] = []
    missing: list[dict[str, Any]] = []
    prompt_mm = text_mm = 0
    prompt_keys: list[str] = []
    text_keys: list[str] = []
    for key in all_keys:
        present = {s: tables[s].get(key) for s in systems}
        absent = [s for s, c in present.items() if c is None]
        if absent:
            missing.append({"key": key, "missing_in": absent})
            continue
        outs = {s: c.get("completion_tokens") for s, c in present.items()}
        if len(set(outs.values())) > 1 or None in outs.values():
            mismatched.append({"key": key, "completion_tokens": outs})
        if len({c.get("prompt_tokens") for c in present.values()}) > 1:
            prompt_mm += 1
            prompt_keys.append(key)
        if len({c.get("text_sha1") for c in present.values()}) > 1:
            text_mm += 1
            text_keys.append(key)
    unexplained = [k for k in prompt_keys if not _explained(k, text_keys)]
    return EqualWork(
        ok=not mismatched and not missing and not unexplained and bool(all_keys),
        calls=len(all_keys),
        mismatched=mismatched,
        missing=missing,
        prompt_mismatched=prompt_mm,
        text_mismatched=text_mm,
        prompt_unexplained=unexplained,
    )


def _split_key(key: str) -> tuple[str, str, int] | None:
    parts = key.rsplit("/", 2)
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    return parts[0], parts[1], int(parts[2])


def _explained(key: str, text_keys: Sequence[str]) -> bool:
    """Whether a prompt mismatch at ``key`` can come from an output-text mismatch it may depend on."""
    me = _split_key(key)
    if me is None:
        return bool(text_keys)  # an unknown key format: do not fail on what we cannot attribute
    run, node, n = me
    for other in text_keys:
        it = _split_key(other)
        if it is None or it[0] != run:
            continue
        if it[1] != node or it[2] < n:
            return True
    return False
