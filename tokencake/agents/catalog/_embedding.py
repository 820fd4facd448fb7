"""A real but simple text embedding: hashed bag of words and word pairs (numpy).

The RAG app needs an embed → retrieve step that works offline with no model download. Hashing
words and adjacent word pairs into a fixed number of buckets (a stable CRC32 hash, so vectors are
identical across processes), log-scaling counts and normalising to unit length gives vectors whose
dot product measures vocabulary overlap — enough for nearest-neighbour retrieval over the corpus.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass

import numpy as np

from tokencake.agents.catalog._corpus import Corpus, word_tokens

DEFAULT_DIM = 512


def embed(text: str, dim: int = DEFAULT_DIM) -> np.ndarray:
    """Unit-length float32 vector of ``text`` (all zeros when it has no usable words)."""
    vec = np.zeros(dim, dtype=np.float32)
    tokens = word_tokens(text[:20_000])
    features = tokens + [f"{a} {b}" for a, b in itertools.pairwise(tokens)]
    for feature in features:
        h = zlib.crc32(feature.encode())
        vec[h % dim] += 1.0 if (h >> 16) & 1 else -1.0  # signed hashing keeps collisions unbiased
    vec = np.sign(vec) * np.log1p(np.abs(vec))
    norm = float(np.linalg.norm(vec))
    return vec / norm if norm > 0 else vec


@dataclass
class VectorIndex:
    """Dense matrix of document embeddings; ``search`` is a cosine top-k."""

    ids: list[str]
    titles: list[str]
    matrix: np.ndarray
    dim: int = DEFAULT_DIM

    @classmethod
    def build(cls, corpus: Corpus, dim: int = DEFAULT_DIM) -> VectorIndex:
        docs = list(corpus.documents.values())
        matrix = np.stack([embed(f"{d.title}. {d.text}", dim) for d in docs])
        return cls([d.id for d in docs], [d.title for d in docs], matrix, dim)

    def search(self, vector: np.ndarray | list[float], k: int = 3) -> list[dict[str, object]]:
        query = np.asarray(vector, dtype=np.float32).reshape(-1)
        if query.shape[0] != self.dim:
            raise ValueError(f"query vector has {query.shape[0]} dimensions, the index {self.dim}")
        scores = self.matrix @ query
        order = np.argsort(-scores, kind="stable")[: max(1, min(int(k), len(self.ids)))]
        # A zero score means no shared feature: not a match, however few documents there are.
        return [
            {"id": self.ids[i], "title": self.titles[i], "score": round(float(scores[i]), 4)}
            for i in order
            if scores[i] > 0
        ]


__all__ = ["DEFAULT_DIM", "VectorIndex", "embed"]
