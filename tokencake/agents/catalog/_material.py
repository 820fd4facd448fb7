"""What catalog tools hand back: seeded, plausible documents, code and test logs of a chosen size.

The workloads TokenCake exists for are agents that carry what their tools return — whole documents,
source files, test logs — so an agent's conversation reaches thousands of tokens. The bundled corpus
articles are a few hundred characters, so tools *expand* what they return to a target size with
deterministic synthetic text: extra sections recombined from corpus sentences of the same topic plus
measurement-style sentences (documents), valid Python helper modules (project files), and verbose
test-runner output built around the real test results (logs). No network, no model: the same
``(seed, key)`` always gives the same bytes, and different seeds give different text, so concurrent
benchmark apps do not share a prefix by accident.

Sizes are in *estimated* tokens (:func:`estimate_tokens`, which counts high: characters / 4 plus
extra for digits and symbols, checked against the SmolLM2 tokenizer), so a conversation estimated
at 3,000 tokens stays inside the bundled model's 4,096-token context with room for the answer.
"""

from __future__ import annotations

import math
import random
import re
from functools import cache
from typing import Any, Literal

#: The bundled model's context; every agent conversation is sized to leave room for its answer.
MODEL_CONTEXT_TOKENS = 4096

ContextLevel = Literal["small", "realistic"]
CONTEXT_LEVELS: tuple[str, ...] = ("small", "realistic")
_SYMBOL = re.compile(r"[^A-Za-z0-9\s]")


def estimate_tokens(text: str) -> int:
    """Tokens of ``text``, estimated high: chars / 4 + 0.75 per digit + 0.3 per symbol.

    Digits and punctuation are what make code and logs dense (SmolLM2 splits numbers into single
    digits); checked against the SmolLM2 tokenizer, this over-counts the catalog's prose by ~15 %
    and its code and logs by a few percent, so budgets based on it are safe.
    """
    text = text or ""
    digits = sum(ch.isdigit() for ch in text)
    symbols = len(_SYMBOL.findall(text))
    return math.ceil(len(text) / 4 + 0.75 * digits + 0.3 * symbols)


def parse_level(context: str) -> str:
    """Validate a ``context`` build parameter (``small`` or ``realistic``)."""
    if context not in CONTEXT_LEVELS:
        raise ValueError(f"context must be one of {', '.join(CONTEXT_LEVELS)}, got {context!r}")
    return context


def rng_for(*key: Any) -> random.Random:
    """A random stream fixed by ``key`` (string seeding is stable across processes)."""
    return random.Random("tokencake-material:" + ":".join(str(k) for k in key))


def fit(text: str, tokens: int) -> str:
    """``text`` cut to at most ``tokens`` estimated tokens, at a line or sentence end when possible."""
    if estimate_tokens(text) <= tokens:
        return text
    limit = int(len(text) * tokens / max(1, estimate_tokens(text)))
    while limit > 0 and estimate_tokens(text[:limit]) > tokens:
        limit = int(limit * 0.97)
    cut = text[:limit]
    end = max(cut.rfind("\n"), cut.rfind(". "))
    return cut[: end + 1] if end > limit * 0.6 else cut


# ---------------------------------------------------------------------- prose


@cache
def _sentences() -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """Corpus sentences by topic, and all of them (the vocabulary of the generated prose)."""
    from tokencake.agents.catalog._corpus import bundled_corpus

    by_topic: dict[str, list[str]] = {}
    for doc in bundled_corpus().documents.values():
        for sentence in re.split(r"(?<=[.!?])\s+", doc.text):
            if len(sentence) > 30:
                by_topic.setdefault(doc.topic or "general", []).append(sentence.strip())
    every = tuple(s for sentences in by_topic.values() for s in sentences)
    return {k: tuple(v) for k, v in by_topic.items()}, every


_SECTIONS = (
    "Background",
    "How it works",
    "Design choices",
    "Measurements",
    "Trade-offs",
    "Failure modes",
    "Operational notes",
    "Related work",
    "Open questions",
)
_SETUPS = ("agents", "requests", "sessions", "workers", "clients", "branches")
_METRICS = (
    "median time to first token",
    "p95 end-to-end latency",
    "recomputed prompt tokens",
    "device cache hit rate",
    "throughput in requests per second",
    "host-to-device copy time",
    "queueing delay",
)


def _measurement(rng: random.Random) -> str:
    n = rng.choice((2, 4, 6, 8, 12, 16, 32))
    blocks = rng.choice((40, 64, 128, 256, 512))
    before = round(rng.uniform(0.8, 9.5), 1)
    after = round(before * rng.uniform(0.35, 0.95), 1)
    return (
        f"In a run with {n} concurrent {rng.choice(_SETUPS)} on {blocks} cache blocks of 128 tokens, the "
        f"{rng.choice(_METRICS)} went from {before} to {after} (seed {rng.randrange(100, 999)}, "
        f"{rng.choice((3, 5, 10))} repetitions)."
    )


def prose(rng: random.Random, tokens: int, topic: str = "") -> str:
    """Paragraphs under section headings, about ``tokens`` estimated tokens long."""
    by_topic, every = _sentences()
    pool = by_topic.get(topic) or every
    out: list[str] = []
    used = 0
    sections = list(_SECTIONS)
    rng.shuffle(sections)
    while used < tokens:
        heading = sections[len(out) % len(sections)]
        sentences = []
        for _ in range(rng.randint(3, 6)):
            if rng.random() < 0.3:
                sentences.append(_measurement(rng))
            else:
                sentences.append(rng.choice(pool if rng.random() < 0.7 else every))
        block = f"## {heading}\n\n" + " ".join(sentences)
        out.append(block)
        used += estimate_tokens(block) + 1
    return fit("\n\n".join(out), tokens)


def document_text(doc_id: str, title: str, topic: str, text: str, tokens: int, seed: int | None) -> str:
    """The full text a fetch returns for a corpus document: its article, then seeded sections.

    The article itself always comes first (search snippets and citations stay true); the expansion
    depends on ``(seed, doc_id)``.
    """
    revision = rng_for("rev", seed, doc_id).randrange(1, 40)
    head = f"# {title}\n\nSource: corpus/{doc_id} · revision {revision}\n\n"
    base = head + text
    room = tokens - estimate_tokens(base) - 2
    if room <= 20:
        return fit(base, max(tokens, 1))
    return base + "\n\n" + prose(rng_for("doc", seed, doc_id), room, topic)


# ---------------------------------------------------------------------- code

_NOUNS = ("record", "segment", "window", "label", "bucket", "token", "entry", "batch", "span", "slot")
_FUNCTION_TEMPLATES = (
    '''def normalize_{noun}s(values: list[int], *, limit: int = {n}) -> list[int]:
    """Clamp {noun} values to [0, limit] and drop repeats, keeping the first occurrence."""
    seen: set[int] = set()
    out: list[int] = []
    for value in values:
        value = max(0, min(limit, value))
        if value not in seen:
            seen.add(value)
            out.append(value)
    return out
''',
    '''def parse_{noun}(text: str, default: int = {n}) -> tuple[str, int]:
    """Split '{noun}=VALUE' into its name and integer value; missing values get the default."""
    name, _, raw = text.partition("=")
    name = name.strip().lower()
    if not name:
        raise ValueError(f"empty {noun} name in {{text!r}}")
    try:
        return name, int(raw) if raw.strip() else default
    except ValueError:
        raise ValueError(f"bad {noun} value in {{text!r}}") from None
''',
    '''def chunk_{noun}s(items: list[str], size: int = {n}) -> list[list[str]]:
    """Consecutive groups of at most `size` {noun}s (the last one may be shorter)."""
    if size < 1:
        raise ValueError("size must be >= 1")
    return [items[i : i + size] for i in range(0, len(items), size)]
''',
    '''def summarize_{noun}s(counts: dict[str, int], top: int = {n}) -> str:
    """The `top` most frequent {noun}s as 'name: count' lines, most frequent first."""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:top]
    width = max((len(name) for name, _ in ranked), default=0)
    return "\\n".join(f"{{name:<{{width}}}}: {{count}}" for name, count in ranked)
''',
    '''class {Noun}Index:
    """Positions of each {noun} in insertion order, for quick lookups by name."""

    def __init__(self) -> None:
        self._positions: dict[str, list[int]] = {{}}
        self._size = 0

    def add(self, name: str) -> int:
        """Record one more {noun}; returns its position."""
        self._positions.setdefault(name, []).append(self._size)
        self._size += 1
        return self._size - 1

    def positions(self, name: str) -> list[int]:
        """Where `name` occurred (empty if never)."""
        return list(self._positions.get(name, []))

    def __len__(self) -> int:
        return self._size
''',
    '''def merge_{noun}_maps(first: dict[str, int], second: dict[str, int]) -> dict[str, int]:
    """Sum two {noun} count maps; keys of either side are kept, in sorted order."""
    keys = sorted(set(first) | set(second))
    return {{key: first.get(key, 0) + second.get(key, 0) for key in keys}}
''',
)


def python_module(name: str, tokens: int, seed: int | None) -> str:
    """A valid, documented Python module of about ``tokens`` estimated tokens (whole functions only)."""
    rng = rng_for("code", seed, name)
    header = f'"""{name}: shared helpers of the project (generated, seed {seed})."""\n\n'
    header += "from __future__ import annotations\n"
    parts = [header]
    used = estimate_tokens(header)
    names: set[str] = set()
    for _ in range(200):
        noun = rng.choice(_NOUNS)
        template = rng.choice(_FUNCTION_TEMPLATES)
        body = template.format(noun=noun, Noun=noun.capitalize(), n=rng.choice((3, 4, 8, 16, 64, 100)))
        first = body.split("(")[0].split(":")[0]
        if first in names:
            continue
        cost = estimate_tokens(body) + 1
        if used + cost > tokens and len(parts) > 1:
            break
        names.add(first)
        parts.append(body)
        used += cost
    return "\n\n".join(parts)


# ---------------------------------------------------------------------- test logs


def runner_log(report: dict[str, Any], tokens: int, seed: int | None, key: str = "") -> str:
    """Verbose test-runner output around the real results in ``report``, about ``tokens`` long.

    ``report`` has ``passed`` (test ids), ``failed`` / ``errors`` (dicts with ``test`` and
    ``message``), ``compile_errors`` and ``files``, as :class:`~._sandbox.TestReport` gives them.
    The real results come first and are never cut (the log is longer than ``tokens`` rather than
    hide a failure); the padding fills it up to the size.
    """
    rng = rng_for("log", seed, key)
    passed = list(report.get("passed") or [])
    failed = list(report.get("failed") or []) + list(report.get("errors") or [])
    compile_errors = list(report.get("compile_errors") or [])
    files = list(report.get("files") or [])
    total = len(passed) + len(failed)
    lines = [
        "============================= test session starts ==============================",
        f"platform linux -- Python 3.12.{rng.randrange(1, 9)}, harness-1.4.{rng.randrange(0, 9)}",
        "rootdir: /sandbox, configfile: none",
        f"collected {total} items from {len(files)} files",
        "",
    ]
    for i, test in enumerate(passed + [f.get("test", "?") for f in failed], 1):
        status = "PASSED" if i <= len(passed) else "FAILED"
        pct = round(100 * i / max(1, total))
        lines.append(f"{test} {status} [{pct}%] ({rng.uniform(0.001, 0.09):.3f}s)")
    for item in compile_errors:
        lines.append(f"ERROR collecting {item.get('file', '?')}: {item.get('error', item)}")
    if failed:
        lines += ["", "=================================== FAILURES ==================================="]
        for f in failed:
            lines += [
                f"____ {f.get('test', '?')} ____",
                f"    {str(f.get('message', '')).strip()[:600]}",
                f"E   {str(f.get('message', '')).splitlines()[0][:200] if f.get('message') else 'failed'}",
                "",
            ]
    head = "\n".join(lines)
    tail = [
        f"========== {len(passed)} passed, {len(failed)} failed, {len(compile_errors)} errors "
        f"in {rng.uniform(0.3, 4.0):.2f}s ==========",
    ]
    room = tokens - estimate_tokens(head) - estimate_tokens(tail[0]) - 2
    pad: list[str] = []
    if room > 60:
        pad.append("\n--------------------------- slowest durations ----------------------------")
        for test in (passed + [f.get("test", "?") for f in failed])[:8]:
            pad.append(f"{rng.uniform(0.01, 0.9):.2f}s call     {test}")
        pad.append("\n----------- coverage: platform linux, python 3.12 -----------")
        pad.append("Name | Stmts | Miss | Cover")
        for name in files or ["(no files)"]:
            stmts = rng.randrange(8, 120)
            miss = rng.randrange(0, stmts // 3 + 1)
            pad.append(f"{name} | {stmts} | {miss} | {round(100 * (1 - miss / stmts))}%")
        pad.append("\n=============================== warnings summary ===============================")
        n = 0
        while estimate_tokens("\n".join(pad)) < room:
            n += 1
            where = rng.choice(files or ["harness.py"])
            pad.append(
                f"{where}:{rng.randrange(1, 200)}: {rng.choice(_WARNINGS)}\n"
                f"  {rng.choice(_WARNING_DETAILS)} (occurrence {n})"
            )
    # The real results are never cut (a log without its failures would mislead); only the padding.
    body = head + fit("\n".join(pad), max(0, tokens - estimate_tokens(head) - estimate_tokens(tail[0]) - 2))
    return body + "\n" + tail[0]


_WARNINGS = (
    "DeprecationWarning: datetime.utcnow() is deprecated; use timezone-aware objects",
    "ResourceWarning: unclosed file <_io.TextIOWrapper name='data.txt' mode='r'>",
    "PytestCollectionWarning: cannot collect test class 'TestConfig' because it has a __init__ constructor",
    "RuntimeWarning: coroutine 'fetch' was never awaited",
    "UserWarning: falling back to the pure-Python implementation",
)
_WARNING_DETAILS = (
    "the value is recomputed on every call; consider caching it",
    "see the project's CONTRIBUTING notes on warnings in tests",
    "this will become an error in the next minor release",
    "enable tracemalloc to get the object allocation traceback",
)


# ---------------------------------------------------------------------- sizing conversations

#: Chat-template tokens around each message (``<|im_start|>role\n … <|im_end|>\n``), rounded up.
MESSAGE_OVERHEAD = 6


def message_tokens(message: dict[str, Any]) -> int:
    """Estimated tokens of one chat message: content, tool-call arguments and template markup."""
    tokens = MESSAGE_OVERHEAD + estimate_tokens(str(message.get("content") or ""))
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        tokens += 10 + estimate_tokens(str(function.get("name", "")) + str(function.get("arguments", "")))
    return tokens


def conversation_tokens(body: dict[str, Any], *, replies_at_max: bool = False) -> int:
    """Estimated context of one chat request once answered: its messages plus ``max_tokens``.

    ``replies_at_max`` counts every earlier assistant message as at least this request's
    ``max_tokens``: what the conversation weighs when the model always uses its whole budget (the
    benchmark forces that with ``ignore_eos``), rather than what a short scripted reply weighs.
    """
    answer = int(body.get("max_tokens") or body.get("max_completion_tokens") or 0)
    total = answer
    for message in body.get("messages") or []:
        tokens = message_tokens(message)
        if replies_at_max and message.get("role") == "assistant":
            tokens = max(tokens, answer + MESSAGE_OVERHEAD)
        total += tokens
    return total


def session_contexts(requests: list[dict[str, Any]], *, replies_at_max: bool = False) -> dict[str, int]:
    """Largest :func:`conversation_tokens` per session id, from recorded request bodies."""
    out: dict[str, int] = {}
    for body in requests:
        meta = (body.get("kv_transfer_params") or {}).get("tokencake") or {}
        session = str(meta.get("session_id", "?"))
        out[session] = max(out.get(session, 0), conversation_tokens(body, replies_at_max=replies_at_max))
    return out


__all__ = [
    "CONTEXT_LEVELS",
    "MESSAGE_OVERHEAD",
    "MODEL_CONTEXT_TOKENS",
    "ContextLevel",
    "conversation_tokens",
    "document_text",
    "estimate_tokens",
    "fit",
    "message_tokens",
    "parse_level",
    "prose",
    "python_module",
    "rng_for",
    "runner_log",
    "session_contexts",
]
