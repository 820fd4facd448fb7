"""The catalog's building blocks: latency model, sandbox, corpus, embedding, text parsing."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import numpy as np
import pytest

from tokencake.agents.catalog._corpus import Corpus, Document, bundled_corpus, query_terms
from tokencake.agents.catalog._embedding import VectorIndex, embed
from tokencake.agents.catalog._latency import LatencyModel
from tokencake.agents.catalog._sandbox import Sandbox, SandboxError
from tokencake.agents.catalog._text import citations, extract_files, numbered_lines, one_line

# ---------------------------------------------------------------------- latency


def test_latency_specs_parse() -> None:
    assert LatencyModel.parse(None).mode == "real"
    assert LatencyModel.parse("paper").spec == "paper"
    scaled = LatencyModel.parse("scaled:0.25")
    assert (scaled.mode, scaled.scale, scaled.spec) == ("scaled", 0.25, "scaled:0.25")
    for bad in ("fast", "scaled:", "scaled:x", "scaled:-1", "scaled:inf"):
        with pytest.raises(ValueError):
            LatencyModel.parse(bad)


def test_latency_targets() -> None:
    assert LatencyModel.parse("real").target("t", 4.0) == 0.0
    assert LatencyModel.parse("paper").target("t", 4.0) == 4.0
    assert LatencyModel.parse("scaled:0.5").target("t", 4.0) == 2.0
    assert LatencyModel.parse("scaled:0").target("t", 4.0) == 0.0


def test_latency_noise_is_seeded_lognormal() -> None:
    a = LatencyModel.parse("paper", noise=0.5, seed=7)
    b = LatencyModel.parse("paper", noise=0.5, seed=7)
    c = LatencyModel.parse("paper", noise=0.5, seed=8)
    xs = [a.target("search", 4.0) for _ in range(200)]
    assert xs == [b.target("search", 4.0) for _ in range(200)]
    assert xs[:10] != [c.target("search", 4.0) for _ in range(10)]
    logs = np.log(np.array(xs) / 4.0)
    assert abs(float(np.median(logs))) < 0.15 and 0.35 < float(np.std(logs)) < 0.65
    # another tool's draws do not shift this tool's stream
    d = LatencyModel.parse("paper", noise=0.5, seed=7)
    d.target("other", 1.0)
    assert d.target("search", 4.0) == xs[0]


def test_pace_sleeps_only_the_remainder() -> None:
    model = LatencyModel.parse("scaled:0.1")  # 2.0 s published -> 0.2 s

    async def body(work: float) -> float:
        start = time.monotonic()
        async with model.pace("t", 2.0):
            await anyio.sleep(work)
        return time.monotonic() - start

    assert 0.19 <= anyio.run(body, 0.0) < 0.4
    assert 0.29 <= anyio.run(body, 0.3) < 0.5  # real work longer than the target: no padding


# ---------------------------------------------------------------------- sandbox


def test_sandbox_confines_paths(tmp_path: Path) -> None:
    box = Sandbox(tmp_path / "box")
    assert box.write("pkg/mod.py", "x = 1\n") == {"path": "pkg/mod.py", "bytes": 6}
    assert box.read("./pkg/mod.py") == "x = 1\n"
    for bad in ("../x.py", "/etc/passwd", "a/../../b.py", "", "~/x", "a b.py", "pkg/../../x"):
        with pytest.raises(SandboxError):
            box.write(bad, "x")
    with pytest.raises(SandboxError, match="no file"):
        box.read("missing.py")
    with pytest.raises(SandboxError, match="limit"):
        box.write("big.txt", "x" * (600 * 1024))
    assert box.files() == ["pkg/mod.py"]


def test_sandbox_runs_tests_and_reports_every_kind_of_failure(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    box.write("calc.py", "def add(a, b):\n    return a + b\n")
    box.write(
        "test_calc.py",
        "import unittest\nfrom calc import add\n\n\ndef test_ok():\n    assert add(1, 2) == 3\n\n\n"
        "def test_wrong():\n    assert add(1, 1) == 3, 'bad sum'\n\n\n"
        "def test_raises():\n    raise KeyError('k')\n\n\n"
        "class T(unittest.TestCase):\n    def test_case(self):\n        self.assertEqual(add(2, 2), 4)\n",
    )
    box.write("test_broken.py", "def f(:\n")
    report = anyio.run(box.run_tests)
    assert not report.ok
    assert sorted(report.passed) == ["test_calc.py::tc_test_test_calc.T.test_case", "test_calc.py::test_ok"]
    assert [f["test"] for f in report.failed] == ["test_calc.py::test_wrong"]
    assert "bad sum" in report.failed[0]["error"]
    assert {e["test"] for e in report.errors} == {"test_calc.py::test_raises", "test_broken.py"}
    assert report.compile_errors[0]["path"] == "test_broken.py"
    assert "2 passed, 1 failed, 2 errors" in report.summary()


def test_sandbox_test_timeout_kills_the_process(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    box.write("test_loop.py", "def test_forever():\n    while True:\n        pass\n")
    start = time.monotonic()
    report = anyio.run(lambda: box.run_tests(timeout=1.0))
    assert report.timed_out and not report.ok
    assert time.monotonic() - start < 5


def test_sandbox_survives_tests_that_exit_or_flood_output(tmp_path: Path) -> None:
    box = Sandbox(tmp_path)
    box.write("test_exit.py", "import os\n\ndef test_exit():\n    os._exit(3)\n")
    report = anyio.run(box.run_tests)
    assert not report.ok and report.returncode == 3
    assert "without a result" in report.errors[0]["error"]
    box.remove()
    box = Sandbox(tmp_path / "b")
    box.write("test_flood.py", "def test_flood():\n    print('x' * 5_000_000)\n")
    report = anyio.run(box.run_tests)
    assert report.ok and len(report.output) <= 4000


def test_stage_copies_without_touching_the_original(tmp_path: Path) -> None:
    box = Sandbox(tmp_path / "main")
    box.write("a.py", "A = 1\n")
    staged = box.stage({"a.py": "A = 2\n", "b.py": "B = 1\n"})
    try:
        assert staged.read("a.py") == "A = 2\n" and staged.read("b.py") == "B = 1\n"
        assert box.read("a.py") == "A = 1\n" and not box.exists("b.py")
    finally:
        staged.remove()
    assert not staged.root.exists()


# ---------------------------------------------------------------------- corpus and embedding


def test_bundled_corpus_ranks_with_bm25() -> None:
    corpus = bundled_corpus()
    assert len(corpus) >= 30
    hits = corpus.search("merge overlapping intervals", 3)
    assert hits[0].id == "interval-merging"
    assert hits[0].score > hits[-1].score > 0
    assert corpus.search("how do I offload the kv cache to host memory", 1)[0].id == "kv-offload"


def test_search_tolerates_garbage_queries() -> None:
    corpus = bundled_corpus()
    assert corpus.search("", 3) == []
    assert corpus.search('"*) OR ( AND -', 3) == []  # FTS syntax characters are not operators
    assert corpus.search("NEAR(kv cache", 3)[0].id  # an FTS keyword is just a word
    assert corpus.search("zzqx wvvk", 3) == []
    assert query_terms("The KV-cache, the KV cache!") == ["kv", "cache"]


def test_corpus_validation_and_lookup() -> None:
    with pytest.raises(ValueError):
        Corpus([])
    doc = Document("a", "A", "t", "alpha text")
    with pytest.raises(ValueError, match="unique"):
        Corpus([doc, doc])
    with pytest.raises(ValueError, match="line 2"):
        Corpus.from_jsonl('{"id": "a", "title": "A", "text": "x"}\n{"id": 1}\n')
    with pytest.raises(KeyError, match="ids look like"):
        bundled_corpus().get("nope")


def test_hashing_embedding_retrieval() -> None:
    v = embed("prefix caching of KV blocks")
    assert v.shape == (512,) and abs(float(np.linalg.norm(v)) - 1.0) < 1e-5
    assert np.array_equal(v, embed("prefix caching of KV blocks"))
    assert not embed("the of and").any()
    index = VectorIndex.build(bundled_corpus())
    assert index.search(embed("how to run untrusted code safely in a sandbox"), 1)[0]["id"] == "sandboxing"
    assert index.search(embed(""), 3) == []
    with pytest.raises(ValueError, match="dimensions"):
        index.search([0.0] * 3)


# ---------------------------------------------------------------------- text parsing


def test_extract_files_formats_and_fallbacks() -> None:
    text = "Here:\n# file: a.py\n```python\nA = 1\n```\nand\nfile: `b.py`\n```\nB = 2\n```"
    assert extract_files(text) == {"a.py": "A = 1\n", "b.py": "B = 2\n"}
    assert extract_files(text, allowed=["a.py"]) == {"a.py": "A = 1\n"}
    unmarked = "```python\nX = 1\n```\n```python\nY = 2\n```"
    assert extract_files(unmarked, allowed=["m.py", "test_m.py"]) == {
        "m.py": "X = 1\n",
        "test_m.py": "Y = 2\n",
    }
    assert extract_files("no code at all", allowed=["m.py"], default="m.py") == {"m.py": "no code at all\n"}
    assert extract_files("", default="m.py") == {}
    assert extract_files("```python\nunterminated", default="m.py") == {"m.py": "unterminated\n"}


def test_list_and_citation_parsing() -> None:
    assert numbered_lines("1. first item\n- second\n\n3) third\nx", 5) == ["first item", "second", "third"]
    assert citations("see [kv-offload] and [kv-offload], [Bad] [x]") == ["kv-offload"]
    assert one_line("\n\n  **Query:** kv cache\nmore") == "Query:** kv cache"
