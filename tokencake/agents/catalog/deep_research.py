"""deep-research: planner → N parallel search+read branches → summaries → synthesis → critic → writer.

A wide fan-out / fan-in app with long tool stalls in every branch: each researcher writes a query,
searches the bundled corpus (BM25 over SQLite FTS5) and fetches the best documents, then a
summarizer condenses them for its sub-question. The synthesizer joins all branches, the critic
checks the synthesis's citations against the corpus (a real lookup), and the writer produces the
report. The report always ends with a references list built from the documents actually read, so
it cites corpus documents even when the model forgets to.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import tokencake as tc
from tokencake.agents.catalog._corpus import bundled_corpus, query_terms
from tokencake.agents.catalog._env import EnvOptions, new_app
from tokencake.agents.catalog._material import document_text
from tokencake.agents.catalog._text import citations, clip, numbered_lines, one_line

if TYPE_CHECKING:
    from typing_extensions import Unpack

NAME = "deep-research"
SHAPE = "fan-out/fan-in: planner → N × (search+read → summary) → synthesizer → critic → writer"
DESCRIPTION = "Researches a question over the bundled corpus in parallel branches and writes a cited report."
DEFAULT_TASK = "How can an LLM server keep agents' KV cache useful while the agents wait for tool calls?"
DEFAULT_INPUTS = {"task": DEFAULT_TASK}

T_SEARCH, T_FETCH, T_CHECK = 3.0, 2.0, 1.0
SEARCH_STAGES = {"query": 0.5, "execute": 2.0, "results": 0.5}
DOCS_PER_BRANCH = 2
#: Estimated tokens of one fetched document, per ``context`` level. A researcher reads two of them
#: into its own conversation: ~2,700 tokens in all at ``realistic`` (~900 at ``small``).
DOC_TOKENS = {"small": 250, "realistic": 1050}
#: Output tokens of each note a researcher takes on a document it read.
NOTE_TOKENS = 96
#: Angles used to fill the plan when the planner gives fewer sub-questions than branches.
_ANGLES = ("background", "mechanisms", "trade-offs", "measurements", "failure modes", "alternatives")


def build(
    *,
    branches: int = 3,
    **options: Unpack[EnvOptions],
) -> tc.App:
    """The deep-research app with ``branches`` parallel search+read branches (1..16)."""
    if not isinstance(branches, int) or not 1 <= branches <= 16:
        raise ValueError(f"branches must be an int in 1..16, got {branches!r}")
    env, app = new_app(NAME, DESCRIPTION, **options)
    doc_tokens = env.size(DOC_TOKENS)

    @app.tool(predict_time=T_SEARCH, kind="search", stages=SEARCH_STAGES, timeout=60.0)
    async def search_corpus(query: str, k: int = 4) -> list[dict[str, Any]]:
        """Full-text search over the document corpus (BM25).

        Args:
            query: keywords.
            k: number of hits.
        """
        async with env.pace("search_corpus", T_SEARCH):
            return [h.to_dict() for h in env.corpus.search(query, k)]

    @app.tool(predict_time=T_FETCH, kind="fetch", timeout=60.0)
    async def fetch_document(doc_id: str) -> dict[str, str]:
        """Read one document of the corpus (the whole page: the article and its further sections).

        Args:
            doc_id: the document id from a search hit.
        """
        async with env.pace("fetch_document", T_FETCH):
            doc = env.corpus.get(doc_id)
            text = document_text(doc.id, doc.title, doc.topic, doc.text, doc_tokens, env.seed)
            return {**doc.to_dict(), "text": text}

    @app.tool(predict_time=T_CHECK, kind="verify")
    async def check_citations(text: str) -> dict[str, Any]:
        """Which ``[doc-id]`` citations in a text exist in the corpus.

        Args:
            text: the text to check.
        """
        async with env.pace("check_citations", T_CHECK):
            cited = citations(text)
            known = [c for c in cited if c in env.corpus.documents]
            return {"cited": cited, "valid": known, "unknown": [c for c in cited if c not in known]}

    def agent(
        name: str, fn: Any, system: str, max_tokens: int, after: list[str], calls: list[str] = ()
    ) -> None:
        app.add_agent(
            env.node(fn),
            name=name,
            system=system,
            max_tokens=env.tokens(max_tokens),
            **env.sampling,
            after=after,
            calls=list(calls),
            agent_type=name.rstrip("0123456789").rstrip("_"),
        )

    async def planner(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        task = str(ctx.inputs["task"])
        reply = await ctx.llm(f"Question: {task}\n\nList {branches} sub-questions to research, one per line.")
        questions = [q for q in numbered_lines(reply.text, branches) if query_terms(q)]
        for angle in _ANGLES * (branches // len(_ANGLES) + 1):
            if len(questions) >= branches:
                break
            questions.append(f"{task} ({angle})")
        return {"task": task, "questions": questions[:branches]}

    agent("planner", planner, "You split research questions into focused sub-questions.", 200, [])

    for i in range(1, branches + 1):

        async def researcher(ctx: tc.Context, inputs: dict[str, Any], i: int = i) -> dict[str, Any]:
            question = inputs["planner"]["questions"][i - 1]
            reply = await ctx.llm(f"Sub-question: {question}\n\nWrite one keyword search query.")
            query = one_line(reply.text)
            if not query_terms(query):
                query = question
            hits = await ctx.call("search_corpus", query=query, k=4)
            if len(hits) < DOCS_PER_BRANCH and query != question:
                # A query that finds too little (small models write odd ones): search again with the
                # sub-question itself, as a researcher would, so the branch still reads its documents.
                seen = {h["id"] for h in hits}
                more = await ctx.call("search_corpus", query=question, k=4)
                hits += [h for h in more if h["id"] not in seen]
            listing = "\n".join(f"- [{h['id']}] {h['title']}: {h['snippet']}" for h in hits) or "- nothing"
            # The researcher reads what it fetched into its own conversation, one document per turn:
            # its context grows by a whole document across every fetch (the KV a server should keep).
            docs, notes = [], []
            for n, hit in enumerate(hits[:DOCS_PER_BRANCH]):
                doc = await ctx.call("fetch_document", doc_id=hit["id"])
                docs.append(doc)
                lead = f"Search results for '{query}':\n{listing}\n\n" if n == 0 else ""
                note = await ctx.llm(
                    f"{lead}Document [{doc['id']}]:\n{doc['text']}\n\n"
                    f"Note what this document says about the sub-question, citing [{doc['id']}].",
                    max_tokens=env.tokens(NOTE_TOKENS),
                )
                notes.append({"id": doc["id"], "note": note.text.strip()})
            return {"question": question, "query": query, "hits": hits, "docs": docs, "notes": notes}

        async def summarizer(ctx: tc.Context, inputs: dict[str, Any], i: int = i) -> dict[str, Any]:
            found = inputs[f"researcher_{i}"]
            sources = [{"id": d["id"], "title": d["title"]} for d in found["docs"]]
            if found["docs"]:
                noted = {n["id"]: n["note"] for n in found["notes"]}
                material = "\n\n".join(
                    f"[{d['id']}] {d['title']}\nNotes: {clip(noted.get(d['id'], ''), 600)}\n"
                    f"Excerpt: {clip(d['text'], 900)}"
                    for d in found["docs"]
                )
            else:
                material = "(the search found nothing)"
            reply = await ctx.llm(
                f"Sub-question: {found['question']}\n\nSources:\n{material}\n\n"
                "Summarise what the sources say about the sub-question in three sentences, citing [doc-id]."
            )
            return {"question": found["question"], "summary": reply.text.strip(), "sources": sources}

        agent(
            f"researcher_{i}",
            researcher,
            "You research one sub-question: you write a keyword search query, then read the documents "
            "it finds and note what they say, citing them as [doc-id].",
            64,
            ["planner"],
            ["search_corpus", *["fetch_document"] * DOCS_PER_BRANCH],
        )
        agent(
            f"summarizer_{i}",
            summarizer,
            "You summarise sources faithfully and cite them as [doc-id].",
            200,
            [f"researcher_{i}"],
        )

    summaries = [f"summarizer_{i}" for i in range(1, branches + 1)]

    async def synthesizer(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        parts = [inputs[name] for name in summaries]
        notes = "\n\n".join(f"Q: {p['question']}\n{clip(p['summary'], 800)}" for p in parts)
        reply = await ctx.llm(
            f"Question: {ctx.inputs['task']}\n\nFindings:\n{notes}\n\n"
            "Combine the findings into one answer of one paragraph, keeping the [doc-id] citations."
        )
        sources: dict[str, str] = {}
        for p in parts:
            sources.update({s["id"]: s["title"] for s in p["sources"]})
        return {"synthesis": reply.text.strip(), "sources": sources, "findings": parts}

    agent("synthesizer", synthesizer, "You synthesise research findings.", 300, summaries)

    async def critic(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        synth = inputs["synthesizer"]
        reply = await ctx.llm(
            f"Answer draft:\n{clip(synth['synthesis'], 1500)}\n\nWhat is missing or unsupported?"
        )
        check = await ctx.call("check_citations", text=synth["synthesis"])
        return {**synth, "critique": reply.text.strip(), "citations": check}

    agent(
        "critic",
        critic,
        "You are a demanding reviewer of research answers.",
        160,
        ["synthesizer"],
        ["check_citations"],
    )

    async def writer(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        draft = inputs["critic"]
        unknown = draft["citations"]["unknown"]
        reply = await ctx.llm(
            f"Question: {ctx.inputs['task']}\n\nDraft:\n{clip(draft['synthesis'], 1500)}\n\n"
            f"Critique: {clip(draft['critique'], 600)}\n"
            + (f"These citations do not exist, drop them: {', '.join(unknown)}\n" if unknown else "")
            + "Write the final report (two short paragraphs), citing sources as [doc-id]."
        )
        body = reply.text.strip()
        cited = [c for c in citations(body) if c in env.corpus.documents]
        sources = draft["sources"]
        refs = "\n".join(
            f"- [{doc_id}] {title}" + ("" if doc_id in cited else " (read, not cited)")
            for doc_id, title in sources.items()
        )
        report = f"# {ctx.inputs['task']}\n\n{body}\n\n## References\n\n{refs or '- none found'}\n"
        return {
            "report": report,
            "cited": cited,
            "sources": [{"id": k, "title": v} for k, v in sources.items()],
            "questions": [f["question"] for f in draft["findings"]],
        }

    agent("writer", writer, "You write clear, well-cited research reports.", 400, ["critic"])
    return app


# ---------------------------------------------------------------------- scripted model

_PLAN = (
    "1. Why does the KV cache of an agent sit idle during a tool call?\n"
    "2. How can idle KV blocks be offloaded to host memory and prefetched back?\n"
    "3. How do prefix caching and critical paths decide which cache to keep?\n"
    "4. What do transfer bandwidth limits mean for offloading?\n"
    "5. How should admission control react to memory pressure?\n"
    "6. How are tool durations forecast?"
)
_QUERIES = (
    "agent tool call KV cache idle",
    "offload KV host memory prefetch",
    "prefix caching critical path eviction",
    "PCIe bandwidth transfer host device",
    "admission control queueing memory",
    "moving average forecast tool duration",
)


def script(request: tc.ScriptedRequest) -> str:
    """Deterministic replies that cite the documents the branches actually read."""
    node = request.node
    prompt = request.prompt
    if node == "planner":
        return _PLAN
    if node.startswith("researcher_"):
        read = re.search(r"Document \[([a-z0-9-]+)\]", prompt)
        if read:
            return f"[{read.group(1)}] explains one mechanism behind the sub-question and what it costs."
        i = int(node.rsplit("_", 1)[1])
        return _QUERIES[(i - 1) % len(_QUERIES)]
    ids = [c for c in citations(prompt) if c in bundled_corpus().documents]
    if node.startswith("summarizer_"):
        if not ids:
            return "The sources found nothing on this sub-question."
        return (
            f"The sources explain the mechanism [{ids[0]}]. "
            + (f"They also describe its costs and limits [{ids[-1]}]. " if len(ids) > 1 else "")
            + "Together they answer the sub-question."
        )
    cite = " ".join(f"[{c}]" for c in ids[:6])
    if node == "synthesizer":
        return (
            "Agents leave their KV cache idle during tool calls; servers can park it in host memory and "
            f"bring it back before the tool returns, guided by the workflow's critical path {cite}."
        )
    if node == "critic":
        return (
            "The draft should quantify transfer costs and say when keeping the cache on the device is better."
        )
    if node == "writer":
        return (
            "While an agent waits for a tool, its KV cache is idle but still needed for the next "
            f"turn {cite}.\n\n"
            "Offloading to host memory frees the device, and a prefetch timed by the predicted tool duration "
            "brings the cache back before the agent resumes; critical-path agents should keep theirs first."
        )
    return "OK"


def final_answer(output: dict[str, Any]) -> str:
    """The report (it ends with its references)."""
    return str(output.get("report", ""))


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
