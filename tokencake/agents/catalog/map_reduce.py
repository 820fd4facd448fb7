"""map-reduce: split → W parallel mappers on one shared system prompt → reducer.

The mappers share a long, identical system prompt, so their requests start with the same tokens:
a prefix cache serves that prefix once for the whole fan-out. Each mapper first fetches its
document (a tool stall), then summarises it; the reducer merges the partial summaries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tokencake as tc
from tokencake.agents.catalog._corpus import bundled_corpus
from tokencake.agents.catalog._env import EnvOptions, new_app
from tokencake.agents.catalog._material import document_text
from tokencake.agents.catalog._text import citations, clip

if TYPE_CHECKING:
    from typing_extensions import Unpack

NAME = "map-reduce"
SHAPE = "wide fan-out: split → W mappers (shared system-prompt prefix) → reduce"
DESCRIPTION = "Summarises the corpus documents on a topic in parallel chunks and merges the summaries."
DEFAULT_TASK = "memory management for the KV cache in LLM serving"
DEFAULT_INPUTS = {"task": DEFAULT_TASK}

T_SEARCH, T_FETCH = 1.5, 1.0
#: Estimated tokens of the document each mapper reads, per ``context`` level (a mapper's whole
#: conversation is ~2,800 tokens at ``realistic``).
DOC_TOKENS = {"small": 350, "realistic": 2450}
#: The mappers' common prefix; long on purpose (it is what a prefix cache would share).
MAPPER_SYSTEM = (
    "You are one of several summarisers working in parallel on parts of a larger collection of documents. "
    "Each of you receives one document and the overall topic. Write a summary of at most three sentences "
    "that keeps only the facts relevant to the topic: mechanisms, numbers, trade-offs and conditions under "
    "which something helps or hurts. Do not add facts the document does not state. Do not greet, do not "
    "repeat the instructions, do not speculate. Start with the document id in square brackets, like "
    "[doc-id], so the reducer can cite it. If the document has nothing on the topic, answer with the id "
    "followed by the words 'not relevant'."
)


def build(
    *,
    width: int = 6,
    **options: Unpack[EnvOptions],
) -> tc.App:
    """The map-reduce app with ``width`` parallel mappers (1..32)."""
    if not isinstance(width, int) or not 1 <= width <= 32:
        raise ValueError(f"width must be an int in 1..32, got {width!r}")
    env, app = new_app(NAME, DESCRIPTION, **options)

    @app.tool(predict_time=T_SEARCH, kind="search")
    async def search_corpus(query: str, k: int = 6) -> list[dict[str, Any]]:
        """Full-text search over the document corpus (BM25).

        Args:
            query: keywords.
            k: number of hits.
        """
        async with env.pace("search_corpus", T_SEARCH):
            return [h.to_dict() for h in env.corpus.search(query, k)]

    @app.tool(predict_time=T_FETCH, kind="fetch")
    async def fetch_document(doc_id: str) -> dict[str, str]:
        """Read one document of the corpus.

        Args:
            doc_id: the document id.
        """
        async with env.pace("fetch_document", T_FETCH):
            doc = env.corpus.get(doc_id)
            text = document_text(doc.id, doc.title, doc.topic, doc.text, env.size(DOC_TOKENS), env.seed)
            return {**doc.to_dict(), "text": text}

    async def split(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        topic = str(ctx.inputs["task"])
        hits = await ctx.call("search_corpus", query=topic, k=width)
        chosen = [h["id"] for h in hits]
        # Fewer matches than mappers: fill with the remaining documents in corpus order, so every
        # mapper has work (and says 'not relevant' when it is).
        for doc_id in env.corpus.ids():
            if len(chosen) >= width:
                break
            if doc_id not in chosen:
                chosen.append(doc_id)
        return {"topic": topic, "chunks": chosen[:width], "matched": len(hits)}

    app.add_function(
        env.node(split), name="split", calls=["search_corpus"], description="pick one document per mapper"
    )

    for i in range(1, width + 1):

        async def mapper(ctx: tc.Context, inputs: dict[str, Any], i: int = i) -> dict[str, Any]:
            plan = inputs["split"]
            doc = await ctx.call("fetch_document", doc_id=plan["chunks"][i - 1])
            reply = await ctx.llm(f"Topic: {plan['topic']}\n\n[{doc['id']}] {doc['title']}\n{doc['text']}")
            return {"id": doc["id"], "title": doc["title"], "summary": reply.text.strip()}

        app.add_agent(
            env.node(mapper),
            name=f"mapper_{i}",
            system=MAPPER_SYSTEM,
            max_tokens=env.tokens(96),
            **env.sampling,
            after=["split"],
            calls=["fetch_document"],
            agent_type="mapper",
        )

    mappers = [f"mapper_{i}" for i in range(1, width + 1)]

    async def reduce(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        parts = [inputs[m] for m in mappers]
        notes = "\n".join(f"- [{p['id']}] {clip(p['summary'], 500)}" for p in parts)
        topic = str(ctx.inputs["task"])
        reply = await ctx.llm(
            f"Topic: {topic}\n\nPartial summaries:\n{notes}\n\nMerge them into one summary citing [doc-id]."
        )
        known = {p["id"] for p in parts}
        return {
            "topic": topic,
            "summary": reply.text.strip(),
            "cited": [c for c in citations(reply.text) if c in known],
            "parts": parts,
        }

    app.add_agent(
        env.node(reduce),
        name="reduce",
        system="You merge partial summaries into one coherent summary and keep their [doc-id] citations.",
        max_tokens=env.tokens(300),
        **env.sampling,
        after=mappers,
        agent_type="reducer",
    )
    return app


def script(request: tc.ScriptedRequest) -> str:
    """Deterministic replies: each mapper summarises its document, the reducer cites them all."""
    ids = [c for c in citations(request.prompt) if c in bundled_corpus().documents]
    if request.node.startswith("mapper_"):
        doc = ids[0] if ids else "unknown"
        return (
            f"[{doc}] The document explains one part of how servers manage KV cache memory and what it costs."
        )
    cite = " ".join(f"[{c}]" for c in ids)
    return f"KV cache memory is managed in blocks that can be shared, evicted, swapped or recomputed {cite}."


def final_answer(output: dict[str, Any]) -> str:
    """The merged summary."""
    return str(output.get("summary", ""))


__all__ = [
    "DEFAULT_INPUTS",
    "DEFAULT_TASK",
    "DESCRIPTION",
    "MAPPER_SYSTEM",
    "NAME",
    "SHAPE",
    "build",
    "script",
]
