"""Realistic contexts: agents carry what their tools return, sized to the bundled model's context."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import tokencake as tc
from tokencake.agents import catalog
from tokencake.agents.catalog import _material as material
from tokencake.agents.catalog._corpus import bundled_corpus

FAST = "scaled:0"
#: Upper bound on any agent's conversation (estimated tokens, its answer budget included).
LIMIT = 3000
TOKENIZER = Path.home() / ".cache/tokencake/models/smollm2-135m-instruct/tokenizer.json"

#: The agents whose conversations carry tool output, and the estimated size each must reach at
#: ``realistic`` (answers at their full budget, as the benchmark forces them).
CARRIERS: dict[str, tuple[str, int]] = {
    "deep-research": ("researcher_", 2400),
    "code-writer": ("programmer_", 2200),
    "map-reduce": ("mapper_", 2400),
    "rag": ("rag", 2300),
    "tool-agent": ("swe_agent", 2400),
}


@cache
def scripted_run(name: str, context: str, seed: int = 3) -> tuple[tc.RunResult, tuple[dict[str, Any], ...]]:
    """One offline run (cached: code-writer runs real subprocess tests) and its request bodies."""
    llm = catalog.scripted_llm(name)
    app = catalog.get_app(name, latency=FAST, context=context, seed=seed)
    result = app.run_sync(llm=llm, **catalog.default_inputs(name))
    return result, tuple(llm.requests)


def contexts(name: str, context: str, seed: int = 3) -> dict[str, int]:
    """Each session's estimated final context, by node (answers at their budget, except tool turns)."""
    _, requests = scripted_run(name, context, seed)
    # A tool-calling turn is a short structured reply, not a max_tokens-long answer: count it as sent.
    at_max = name != "tool-agent"
    sizes = material.session_contexts(list(requests), replies_at_max=at_max)
    return {session.split(":", 1)[1]: tokens for session, tokens in sizes.items()}


@pytest.mark.parametrize("name", catalog.app_names())
def test_apps_run_offline_and_carriers_reach_the_intended_size(name: str) -> None:
    result, _ = scripted_run(name, "realistic")
    assert result.status == "ok"
    prefix, target = CARRIERS[name]
    sizes = contexts(name, "realistic")
    carriers = {node: tokens for node, tokens in sizes.items() if node.startswith(prefix)}
    assert carriers
    assert max(sizes.values()) <= LIMIT, sizes
    # Every carrier of tool output is thousands of tokens; the largest reaches the target.
    assert max(carriers.values()) >= target, carriers
    assert min(carriers.values()) >= 1400, carriers


@pytest.mark.parametrize("name", catalog.app_names())
def test_small_context_is_much_smaller(name: str) -> None:
    prefix, _ = CARRIERS[name]
    small = {n: t for n, t in contexts(name, "small").items() if n.startswith(prefix)}
    big = {n: t for n, t in contexts(name, "realistic").items() if n.startswith(prefix)}
    assert max(small.values()) <= 0.7 * max(big.values())
    assert max(small.values()) <= 2000


def test_context_parameter_is_validated_and_listed() -> None:
    with pytest.raises(ValueError, match="small, realistic"):
        catalog.get_app("rag", context="huge")
    for name in catalog.app_names():
        assert catalog.build_params(name)["context"] == "realistic"


def _messages_of(requests: tuple[dict[str, Any], ...], node: str) -> list[list[dict[str, Any]]]:
    return [b["messages"] for b in requests if b["kv_transfer_params"]["tokencake"]["node"] == node]


def test_researchers_read_the_fetched_documents_into_their_conversation() -> None:
    result, requests = scripted_run("deep-research", "realistic")
    docs = result.nodes["researcher_1"].output["docs"]
    assert len(docs) == 2
    turns = _messages_of(requests, "researcher_1")
    assert len(turns) == 3  # query, then one reading turn per fetched document
    last = "\n".join(str(m["content"]) for m in turns[-1])
    for doc in docs:
        assert doc["text"] in last  # the whole document, not a clip
        assert material.estimate_tokens(doc["text"]) >= 900
        assert doc["text"].startswith(f"# {doc['title']}")
        assert bundled_corpus().get(doc["id"]).text in doc["text"]  # the article itself comes first
    # Each turn continues the same conversation: the earlier turn is a prefix of the next.
    assert turns[2][: len(turns[1])] == turns[1]


def test_programmer_repair_continues_the_patch_conversation_with_the_test_log() -> None:
    result, requests = scripted_run("code-writer", "realistic")
    patch = _messages_of(requests, "programmer_1_validate_patch")[0]
    repair = _messages_of(requests, "programmer_1_repair")[0]
    assert repair[: len(patch)] == patch  # same system prompt, same tokens: the KV prefix carries over
    assert repair[len(patch)]["role"] == "assistant"  # the patch itself
    log = result.nodes["programmer_1_validate_patch"].output["validation"]["log"]
    assert "test session starts" in log and log in repair[-1]["content"]
    assert material.estimate_tokens(log) >= 450
    # The patch prompt holds the style guide and an existing project module.
    assert "# Contributing" in patch[1]["content"] and "project/" in patch[1]["content"]
    # The seeded project is real code: it compiles and the final test run is unaffected by it.
    assert result.output["tests_passed"] is True
    assert "project/text_utils.py" in result.output["files"]


def test_tool_agent_keeps_its_tool_results() -> None:
    result, requests = scripted_run("tool-agent", "realistic")
    assert result.output["fixed"] is True
    last = list(requests)[-1]["messages"]
    tool_messages = [m["content"] for m in last if m["role"] == "tool"]
    assert len(tool_messages) == 7
    readme = next(t for t in tool_messages if t.startswith("# textutils"))
    assert material.estimate_tokens(readme) >= 450
    assert any("test session starts" in t for t in tool_messages)


def test_same_seed_same_bytes_other_seed_other_material() -> None:
    def bodies(seed: int) -> list[Any]:
        _, requests = scripted_run("deep-research", "realistic", seed)
        return sorted(
            (b["kv_transfer_params"]["tokencake"]["node"], str(b["messages"]), b["max_tokens"])
            for b in requests
        )

    scripted_run.cache_clear()
    first = bodies(11)
    scripted_run.cache_clear()
    assert bodies(11) == first
    assert bodies(12) != first
    # ... but only the expansion differs: the articles (and so the citations) are the same.
    doc = bundled_corpus().get("paged-attention")
    a = material.document_text(doc.id, doc.title, doc.topic, doc.text, 1000, 11)
    b = material.document_text(doc.id, doc.title, doc.topic, doc.text, 1000, 12)
    assert a != b and doc.text in a and doc.text in b


# ---------------------------------------------------------------------- material


def test_generated_module_is_valid_documented_code() -> None:
    for seed in range(5):
        code = material.python_module("project/x.py", 600, seed)
        tree = ast.parse(code)
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        assert functions and all(ast.get_docstring(f) for f in functions if not f.name.startswith("__"))
        assert max(len(line) for line in code.splitlines()) <= 100
        assert 450 <= material.estimate_tokens(code) <= 600


def test_runner_log_puts_real_results_first_and_keeps_its_size() -> None:
    report = {
        "passed": [f"test_a.py::test_{i}" for i in range(4)],
        "failed": [{"test": "test_b.py::test_bad", "message": "AssertionError: 3 != 4"}],
        "files": ["a.py", "test_a.py", "test_b.py"],
    }
    tiny = material.runner_log(report, 20, 1, "k")
    assert "slowest durations" not in tiny  # too small for padding, yet nothing real is cut
    for tokens in (20, 550):
        log = material.runner_log(report, tokens, 1, "k")
        assert material.estimate_tokens(log) <= max(tokens, material.estimate_tokens(tiny))
        assert "test_b.py::test_bad FAILED" in log and "AssertionError: 3 != 4" in log
        assert log.rstrip().endswith("==========") and "4 passed, 1 failed" in log
    assert material.estimate_tokens(material.runner_log(report, 550, 1, "k")) >= 500


def test_fit_and_estimate() -> None:
    text = "word " * 1000
    assert material.estimate_tokens(text) == 1250
    cut = material.fit(text, 100)
    assert material.estimate_tokens(cut) <= 100 and len(cut) > 300
    assert material.estimate_tokens("12345") == 5  # 5 / 4 + 0.75 per digit: digits weigh more
    assert material.conversation_tokens({"messages": [], "max_tokens": 64}) == 64


@pytest.mark.skipif(not TOKENIZER.exists(), reason="the bundled model is not prepared on this machine")
@pytest.mark.parametrize("name", catalog.app_names())
def test_estimates_are_upper_bounds_of_real_tokens(name: str) -> None:
    """The SmolLM2 tokenizer counts no more than the estimate, so 4,096 is never reached."""
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers comes with the serve extras (vLLM)")
    tokenizer = tokenizers.Tokenizer.from_file(str(TOKENIZER))
    _, requests = scripted_run(name, "realistic")
    body = max(requests, key=lambda b: material.conversation_tokens(b))
    real = sum(
        len(tokenizer.encode(str(m.get("content") or "")).ids) + material.MESSAGE_OVERHEAD
        for m in body["messages"]
    )
    estimate = material.conversation_tokens(body) - int(body["max_tokens"])
    assert real <= estimate
    assert real >= 0.75 * estimate  # and not so loose that the sizes mean little
    assert real + int(body["max_tokens"]) < material.MODEL_CONTEXT_TOKENS - 500


def test_a_query_that_finds_nothing_is_retried_with_the_sub_question() -> None:
    """Garbage queries (the benchmark's forced outputs) must not leave a researcher without documents."""

    def script(request: tc.ScriptedRequest) -> str:
        if request.node.startswith("researcher_") and "Document [" not in request.prompt:
            return "zzzqx vvvbn"  # words no document contains
        return catalog.scripted_replies("deep-research")(request)

    llm = tc.ScriptedLLM(script)
    app = catalog.get_app("deep-research", latency=FAST, branches=2)
    result = app.run_sync(llm=llm, **catalog.default_inputs("deep-research"))
    for i in (1, 2):
        out = result.nodes[f"researcher_{i}"].output
        assert len(out["docs"]) == 2 and result.nodes[f"researcher_{i}"].tool_calls == 4
    sizes = material.session_contexts(llm.requests, replies_at_max=True)
    assert min(t for s, t in sizes.items() if ":researcher_" in s) >= 2400
