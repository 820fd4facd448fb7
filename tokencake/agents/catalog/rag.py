"""rag: one node with the paper's FuncNode stages — query → embed → retrieve → generate.

A single agent keeps one conversation across all four stages, so its KV cache is exactly what a
server would want to keep during the two tool stalls in the middle. The embedding is a real,
dependency-free one (hashed bag of words and word pairs, numpy) and retrieval is a cosine top-k
over the bundled corpus.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tokencake as tc
from tokencake.agents.catalog._corpus import bundled_corpus, query_terms
from tokencake.agents.catalog._embedding import DEFAULT_DIM, VectorIndex, embed
from tokencake.agents.catalog._env import EnvOptions, new_app
from tokencake.agents.catalog._material import document_text
from tokencake.agents.catalog._text import citations, one_line

if TYPE_CHECKING:
    from typing_extensions import Unpack

NAME = "rag"
SHAPE = "single node with stages: query → embed → retrieve → generate"
DESCRIPTION = "Retrieval-augmented answer: rewrites the question, embeds it, retrieves passages, cites them."
DEFAULT_TASK = "What is prefix caching and when does it help multi-turn agents?"
DEFAULT_INPUTS = {"task": DEFAULT_TASK}

T_EMBED, T_RETRIEVE = 0.3, 0.8
RETRIEVE_STAGES = {"search": 0.6, "load": 0.2}
#: Estimated tokens of all retrieved passages together, per ``context`` level (split over the k
#: passages); the agent's one conversation is ~2,700 tokens at ``realistic``.
PASSAGE_TOKENS = {"small": 600, "realistic": 2250}


def build(
    *,
    k: int = 3,
    **options: Unpack[EnvOptions],
) -> tc.App:
    """The rag app; ``k`` passages are retrieved (1..10)."""
    if not isinstance(k, int) or not 1 <= k <= 10:
        raise ValueError(f"k must be an int in 1..10, got {k!r}")
    env, app = new_app(NAME, DESCRIPTION, **options)
    index: list[VectorIndex] = []  # built on first use, shared by runs of this app object

    @app.tool(predict_time=T_EMBED, kind="embed")
    async def embed_text(text: str) -> list[float]:
        """Embed a text as a unit vector (hashed bag of words and word pairs).

        Args:
            text: the text to embed.
        """
        async with env.pace("embed_text", T_EMBED):
            return [round(float(x), 6) for x in embed(text, DEFAULT_DIM)]

    @app.tool(predict_time=T_RETRIEVE, kind="retrieval", stages=RETRIEVE_STAGES)
    async def retrieve(vector: list[float], k: int = 3) -> list[dict[str, Any]]:
        """The corpus passages closest to a query vector (cosine similarity).

        Args:
            vector: query embedding from embed_text.
            k: number of passages.
        """
        async with env.pace("retrieve", T_RETRIEVE):
            if not index:
                index.append(VectorIndex.build(env.corpus))
            hits = index[0].search(vector, k)
            size = env.size(PASSAGE_TOKENS) // max(1, len(hits))
            out = []
            for h in hits:
                doc = env.corpus.get(str(h["id"]))
                text = document_text(doc.id, doc.title, doc.topic, doc.text, size, env.seed)
                out.append({**h, "text": text})
            return out

    async def rag(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        question = str(ctx.inputs["task"])
        # Stage 1 (query): the model rewrites the question into search keywords.
        rewrite = await ctx.llm(
            f"Question: {question}\n\nRewrite it as search keywords.", max_tokens=env.tokens(32)
        )
        query = one_line(rewrite.text)
        if not query_terms(query):
            query = question
        # Stages 2-3 (embed, retrieve): two tool stalls in the middle of one conversation.
        vector = await ctx.call("embed_text", text=f"{query} {question}")
        passages = await ctx.call("retrieve", vector=vector, k=k)
        # Stage 4 (generate): the answer continues the same conversation (same KV prefix).
        context = "\n\n".join(f"[{p['id']}] {p['title']}\n{p['text']}" for p in passages) or "(none)"
        answer = await ctx.llm(
            f"Passages:\n{context}\n\nAnswer the question using the passages; cite them as [doc-id]."
        )
        cited = [c for c in citations(answer.text) if c in env.corpus.documents]
        return {
            "question": question,
            "query": query,
            "answer": answer.text.strip(),
            "cited": cited,
            "sources": [{"id": p["id"], "title": p["title"], "score": p["score"]} for p in passages],
        }

    app.add_agent(
        env.node(rag),
        name="rag",
        system="You answer questions from retrieved passages and cite them as [doc-id].",
        max_tokens=env.tokens(256),
        **env.sampling,
        calls=["embed_text", "retrieve"],
        agent_type="rag",
    )
    return app


def script(request: tc.ScriptedRequest) -> str:
    """Deterministic replies: keywords first, then an answer citing the retrieved passages."""
    if "Rewrite it as search keywords" in request.prompt:
        return "prefix caching reuse KV blocks multi-turn agents"
    ids = [c for c in citations(request.prompt) if c in bundled_corpus().documents]
    cite = " ".join(f"[{c}]" for c in ids[:2])
    return (
        "Prefix caching keeps the KV blocks of earlier requests, indexed by a hash of their tokens, so a "
        f"request that starts with the same tokens reuses them instead of recomputing the prefill {cite}. "
        "It helps multi-turn agents because each turn extends the previous conversation, as long as the "
        "blocks are not evicted during long pauses."
    )


def final_answer(output: dict[str, Any]) -> str:
    """The answer and the passages it was given."""
    sources = ", ".join(f"[{s['id']}] {s['title']}" for s in output.get("sources", []))
    return f"{output.get('answer', '')}\n\nRetrieved: {sources or 'nothing'}"


__all__ = [
    "DEFAULT_INPUTS",
    "DEFAULT_TASK",
    "DESCRIPTION",
    "NAME",
    "SHAPE",
    "build",
    "final_answer",
    "script",
]
