"""The bundled offline document corpus and its full-text index (SQLite FTS5, BM25 ranking).

Catalog apps must run without internet, yet search tools should do real ranking work so that
queries written by a model (good or garbage) lead to different documents. The corpus is a few
dozen short original articles (``corpus.jsonl``) indexed in an in-memory SQLite FTS5 table
with the porter stemmer; :meth:`Corpus.search` ranks with SQLite's ``bm25()``.

Model-written queries are free text, not FTS syntax, so they are reduced to plain word tokens
OR-ed together before matching; an unmatchable query returns no hits instead of an error.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources
from typing import Any

_WORD = re.compile(r"[A-Za-z0-9]+")
#: Words too common to help ranking; FTS5 has no stop list of its own.
_STOP = frozenset(
    "a an and are as at be by can do does for from has have how i if in into is it its of on or "
    "so that the their then there these this to was what when where which while who why will with "
    "you your".split()
)
MAX_QUERY_TERMS = 24


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    topic: str
    text: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Hit:
    """One search result: ``score`` is BM25 relevance (higher is better, unlike SQLite's sign)."""

    id: str
    title: str
    score: float
    snippet: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def word_tokens(text: str) -> list[str]:
    """Lower-cased word tokens of ``text`` without stop words and single characters, in order."""
    return [w for w in _WORD.findall(text.lower()) if w not in _STOP and len(w) > 1]


def query_terms(text: str) -> list[str]:
    """:func:`word_tokens` without duplicates, capped at ``MAX_QUERY_TERMS``."""
    return list(dict.fromkeys(word_tokens(text)))[:MAX_QUERY_TERMS]


class Corpus:
    """An in-memory FTS5 index over ``documents`` (safe to share between threads)."""

    def __init__(self, documents: list[Document]) -> None:
        if not documents:
            raise ValueError("a corpus needs at least one document")
        ids = [d.id for d in documents]
        if len(set(ids)) != len(ids):
            raise ValueError("document ids must be unique")
        self.documents = {d.id: d for d in documents}
        self._lock = threading.Lock()
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._db.execute(
            "CREATE VIRTUAL TABLE docs USING fts5(id UNINDEXED, title, text, tokenize='porter unicode61')"
        )
        self._db.executemany(
            "INSERT INTO docs (id, title, text) VALUES (?, ?, ?)",
            [(d.id, d.title, d.text) for d in documents],
        )

    @classmethod
    def from_jsonl(cls, text: str) -> Corpus:
        docs = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    raw = json.loads(line)
                    docs.append(
                        Document(
                            str(raw["id"]), str(raw["title"]), str(raw.get("topic", "")), str(raw["text"])
                        )
                    )
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise ValueError(f"corpus line {n}: {exc}") from exc
        return cls(docs)

    def __len__(self) -> int:
        return len(self.documents)

    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The ``k`` best documents for free-text ``query`` (title matches weigh double)."""
        terms = query_terms(query if isinstance(query, str) else str(query))
        k = max(1, min(int(k), 50))
        if not terms:
            return []
        match = " OR ".join(f'"{t}"' for t in terms)
        with self._lock:
            rows = self._db.execute(
                "SELECT id, title, bm25(docs, 0.0, 2.0, 1.0) AS rank, "
                "snippet(docs, 2, '', '', ' … ', 24) FROM docs WHERE docs MATCH ? ORDER BY rank LIMIT ?",
                (match, k),
            ).fetchall()
        return [Hit(id=r[0], title=r[1], score=round(-float(r[2]), 4), snippet=r[3]) for r in rows]

    def get(self, doc_id: str) -> Document:
        """The document with ``doc_id``; ``KeyError`` lists a few valid ids."""
        doc = self.documents.get(str(doc_id).strip())
        if doc is None:
            sample = ", ".join(list(self.documents)[:5])
            raise KeyError(f"no document {doc_id!r} in the corpus (ids look like: {sample}, …)")
        return doc

    def ids(self) -> list[str]:
        return list(self.documents)


@cache
def bundled_corpus() -> Corpus:
    """The corpus shipped in ``tokencake/agents/catalog/corpus.jsonl`` (loaded once)."""
    text = resources.files("tokencake.agents.catalog").joinpath("corpus.jsonl").read_text("utf-8")
    return Corpus.from_jsonl(text)


__all__ = ["Corpus", "Document", "Hit", "bundled_corpus", "query_terms", "word_tokens"]
