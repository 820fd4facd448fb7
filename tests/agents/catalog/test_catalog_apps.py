"""Every bundled app on the scripted model (fast latency): artifacts, stall pairing, robustness."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import httpx
import networkx as nx
import pytest

import tokencake as tc
from tokencake.agents import catalog
from tokencake.agents.catalog import tool_agent
from tokencake.agents.catalog._corpus import bundled_corpus
from tokencake.agents.catalog._sandbox import Sandbox
from tokencake.agents.catalog.code_writer._script import SOLUTION

FAST = "scaled:0"


def run(name: str, llm: tc.LLM | None = None, **params) -> tuple[tc.RunResult, tc.StallRecorder]:
    app = catalog.get_app(name, latency=FAST, **params)
    recorder = tc.StallRecorder()
    result = app.run_sync(
        llm=llm or catalog.scripted_llm(name), stall=recorder, **catalog.default_inputs(name)
    )
    return result, recorder


def assert_stalls_match_tools(result: tc.RunResult, recorder: tc.StallRecorder) -> int:
    """One complete begin/end pair per tool call, consistent across recorder, result and events."""
    tool_calls = sum(n.tool_calls for n in result.nodes.values())
    started = [e for e in result.events if e.kind == "tool_started"]
    pairs = recorder.pairs()
    assert tool_calls > 0
    assert len(pairs) == tool_calls == len(started)
    assert all(end is not None for _, end in pairs), "every stall_begin needs its stall_end"
    assert len(result.stall_events) == 2 * tool_calls
    for begin, end in pairs:
        assert end.session_id == begin.session_id == f"{result.run_id}:{begin.node}"
        assert end.tool == begin.tool
    return tool_calls


@pytest.mark.parametrize("name", catalog.app_names())
def test_every_app_runs_on_its_script_with_paired_stalls(name: str, tmp_path: Path) -> None:
    result, recorder = run(name, workdir=str(tmp_path))
    assert result.status == "ok"
    assert all(n.status == "ok" for n in result.nodes.values())
    assert_stalls_match_tools(result, recorder)
    # The scripted replies fit the nodes' token budgets (a truncated reply would be broken code).
    finishes = [e.data["finish_reason"] for e in result.events if e.kind == "llm_finished"]
    assert finishes and "length" not in finishes
    assert catalog.final_answer(name, result.output).strip()
    json.dumps(result.to_dict())  # the whole result is JSON-able


def test_code_writer_shape_matches_the_published_table() -> None:
    app = catalog.get_app("code-writer")
    graph = app.graph
    assert graph.number_of_nodes() == 29
    assert graph.number_of_edges() == 36
    assert nx.dag_longest_path_length(graph) == 17
    agents = [n for n in app.nodes.values() if n.kind == "agent"]
    assert len(agents) == 27
    budgets = {n.name: n.max_tokens for n in agents}
    assert budgets["architect_1"] == budgets["architect_2"] == 200
    assert budgets["search_1"] == budgets["judger_2"] == budgets["file_write_plan"] == 128
    assert all(budgets[f"programmer_{k}_{s}"] == 400 for k in (1, 2, 3) for s in ("validate_patch", "repair"))
    assert all(budgets[f"reviewer_{r}"] == 200 for r in (1, 2))
    assert all(budgets[f"reviser_{r}_{s}"] == 400 for r in (1, 2) for s in ("validate_patch", "repair"))
    assert budgets["external_eval"] == budgets["user_confirm"] == budgets["test_node"] == 128
    tools = app.tools
    assert tools["web_search"].predict_time == 4.0
    assert tools["web_search"].stages == {"query": 0.5, "execute": 1.0, "results": 0.5}
    assert tools["conditional_check"].predict_time == 0.4
    assert tools["write_files"].predict_time == 0.1
    assert tools["validate_patch"].predict_time == 8.0
    assert tools["validate_revision"].predict_time == 10.0
    assert tools["external_evaluation"].predict_time == 4.5
    assert tools["confirm_with_user"].predict_time == 3.5
    assert tools["run_tests"].stages == {"style": 0.5, "compile": 1.0, "functional": 2.0, "report": 1.0}
    assert set(graph.predecessors("reviewer_1")) == {"code_write_1", "code_write_2", "code_write_3"}
    assert set(graph.successors("file_write_plan")) == {f"programmer_{k}_validate_patch" for k in (1, 2, 3)}
    assert app.critical_path[0] == "start" and app.critical_path[-1] == "end"


def test_code_writer_writes_files_and_generated_tests_pass(tmp_path: Path) -> None:
    result, recorder = run("code-writer", workdir=str(tmp_path))
    out = result.output
    root = Path(out["sandbox"])
    assert root.parent == tmp_path
    for k in (1, 2, 3):
        module = SOLUTION[k][0]
        assert (root / module).is_file() and (root / f"test_{module}").is_file()
    assert (root / "PLAN.md").read_text().count(".py") >= 6
    assert out["tests_passed"] is True and out["approved"] is True
    assert len(out["tests"]["passed"]) == 10  # includes the test the reviser added
    # The revision passed its guarded write: the reviewed file now rejects negative totals.
    assert "negative" in (root / "ranges_report.py").read_text()
    report = json.loads((root / "TEST_REPORT.json").read_text())
    assert report["ok"] is True and report["failed"] == []
    # Independently re-run the generated tests in a fresh subprocess.
    again = anyio.run(Sandbox(root).run_tests)
    assert again.ok and len(again.passed) == 10
    # 2 searches, 2 checks, plan + 3 + 2 writes, 3 + 2 validations, eval, confirm, test.
    assert assert_stalls_match_tools(result, recorder) == 18
    predicted = {ev.tool: ev.predicted_s for ev, _ in recorder.pairs()}
    assert predicted["validate_patch"] == 8.0 and predicted["web_search"] == 4.0  # hints unchanged by latency


def test_code_writer_survives_a_model_that_writes_garbage(tmp_path: Path) -> None:
    garbage = tc.ScriptedLLM("the the the ``` def ( :: 42 lorem ipsum")
    result, recorder = run("code-writer", llm=garbage, workdir=str(tmp_path))
    out = result.output
    assert result.status == "ok"
    assert out["tests_passed"] is False
    assert out["tests"]["problems"], "the failure is reported"
    plan = result.nodes["file_write_plan"].output
    assert [p["module"] for p in plan["parts"]] == ["part_1.py", "part_2.py", "part_3.py"]
    validation = result.nodes["programmer_1_validate_patch"].output["validation"]
    assert validation["ok"] is False and validation["problems"]
    assert_stalls_match_tools(result, recorder)


def test_code_writer_refuses_paths_outside_the_sandbox(tmp_path: Path) -> None:
    evil = "# file: ../evil.py\n```python\nprint('x')\n```"

    def script(req: tc.ScriptedRequest) -> str:
        return "1. ../evil.py: escape\n2. /etc/x.py: abs\n" if req.node == "file_write_plan" else evil

    result, _ = run("code-writer", llm=tc.ScriptedLLM(script), workdir=str(tmp_path))
    assert result.status == "ok"
    assert not (tmp_path / "evil.py").exists()
    assert all(".." not in f for f in result.output["files"])


def test_deep_research_report_cites_corpus_documents(tmp_path: Path) -> None:
    result, recorder = run("deep-research", branches=4, workdir=str(tmp_path))
    out = result.output
    corpus = bundled_corpus()
    assert len([n for n in result.nodes if n.startswith("researcher_")]) == 4
    assert out["cited"], "the report cites documents"
    assert all(doc_id in corpus.documents for doc_id in out["cited"])
    for doc_id in out["cited"]:
        assert f"[{doc_id}] {corpus.get(doc_id).title}" in out["report"]
    assert "## References" in out["report"]
    # 4 branches x (1 search + 2 fetches) + 1 citation check
    assert assert_stalls_match_tools(result, recorder) == 13


def test_deep_research_with_a_useless_model_still_lists_what_it_read() -> None:
    result, recorder = run("deep-research", llm=tc.ScriptedLLM("???"))
    out = result.output
    assert result.status == "ok"
    assert out["sources"], "queries fall back to the sub-questions, which find documents"
    assert "## References" in out["report"]
    assert len(out["questions"]) == 3
    assert_stalls_match_tools(result, recorder)


def test_rag_retrieves_and_cites() -> None:
    result, recorder = run("rag")
    out = result.output
    assert out["sources"][0]["id"] == "prefix-caching"
    assert "prefix-caching" in out["cited"]
    node = result.nodes["rag"]
    assert node.llm_calls == 2 and node.tool_calls == 2  # query, embed, retrieve, generate
    assert [ev.tool for ev, _ in recorder.pairs()] == ["embed_text", "retrieve"]


def test_map_reduce_fans_out_on_a_shared_system_prompt() -> None:
    llm = catalog.scripted_llm("map-reduce")
    result, _ = run("map-reduce", llm=llm, width=5)
    mapper_bodies = [
        b for b in llm.requests if b["kv_transfer_params"]["tokencake"]["node"].startswith("mapper_")
    ]
    assert len(mapper_bodies) == 5
    systems = {b["messages"][0]["content"] for b in mapper_bodies}
    assert systems == {catalog.map_reduce.MAPPER_SYSTEM}
    out = result.output
    assert len(out["parts"]) == 5 and len({p["id"] for p in out["parts"]}) == 5
    assert out["cited"]


def test_tool_agent_fixes_the_bug_through_model_tool_calls(tmp_path: Path) -> None:
    result, recorder = run("tool-agent", workdir=str(tmp_path))
    out = result.output
    assert out["fixed"] is True and out["mode"] == "tools"
    assert "text.split()" in (Path(out["sandbox"]) / "textutils.py").read_text()
    tools = [ev.tool for ev, _ in recorder.pairs()]
    assert tools == [
        "list_files",
        "read_file",
        "read_file",
        "run_tests",
        "search_docs",
        "write_file",
        "run_tests",
        "run_tests",
    ]
    assert result.nodes["swe_agent"].llm_calls == 8


def test_tool_agent_reports_an_unfixed_project_when_the_model_is_useless() -> None:
    result, _ = run("tool-agent", llm=tc.ScriptedLLM("I do not know."))
    assert result.output["fixed"] is False
    assert result.output["problems"]


def test_tool_agent_returns_tool_errors_to_the_model() -> None:
    calls = iter(
        [
            tc.ToolCall(id="c1", name="read_file", arguments={"path": "../../etc/passwd"}),
            tc.ToolCall(id="c2", name="read_file", arguments={"path": "missing.py"}),
            "giving up",
        ]
    )
    llm = tc.ScriptedLLM(lambda req: next(calls))
    result, _ = run("tool-agent", llm=llm)
    tool_msgs = [m["content"] for m in llm.requests[-1]["messages"] if m["role"] == "tool"]
    assert tool_msgs[0].startswith("error:") and "not allowed" in tool_msgs[0]
    assert tool_msgs[1].startswith("error:") and "no file 'missing.py'" in tool_msgs[1]
    assert result.output["fixed"] is False


def test_tool_agent_falls_back_to_text_tools_when_the_server_rejects_tools() -> None:
    """A vLLM server without a tool parser answers 400 to requests with tools."""
    steps = iter(
        [
            'CALL read_file {"path": "textutils.py"}',
            "CALL nonsense {}",
            'CALL write_file {"path": "textutils.py", "content": ' + json.dumps(tool_agent._FIXED) + "}",
            "CALL run_tests {}",
            "DONE fixed word_count",
        ]
    )
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})
        body = json.loads(request.content)
        seen.append(body)
        if body.get("tools"):
            message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            return httpx.Response(400, json={"error": {"message": message, "type": "BadRequestError"}})
        message = {"role": "assistant", "content": next(steps)}
        return httpx.Response(
            200,
            json={
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            },
        )

    llm = tc.LLM(
        "http://fake.invalid/v1",
        "m",
        events_url=False,
        max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
    )
    result, recorder = run("tool-agent", llm=llm)
    out = result.output
    assert out["mode"] == "text" and out["fixed"] is True
    assert "unknown tool 'nonsense'" in seen[3]["messages"][-1]["content"]
    assert [ev.tool for ev, _ in recorder.pairs()] == ["read_file", "write_file", "run_tests", "run_tests"]


def test_tool_agent_reports_a_context_overflow_instead_of_failing() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})
        body = json.loads(request.content)
        if len(body["messages"]) > 3:  # the second turn "outgrows the context"
            message = "This model's maximum context length is 4096 tokens."
            return httpx.Response(400, json={"error": {"message": message, "type": "BadRequestError"}})
        call = {"id": "c1", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        return httpx.Response(
            200,
            json={
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            },
        )

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    llm = tc.LLM("http://fake.invalid/v1", "m", events_url=False, max_retries=0, http_client=client)
    result, recorder = run("tool-agent", llm=llm)
    out = result.output
    assert out["mode"] == "tools" and out["fixed"] is False
    assert "maximum context length" in out["stopped"]
    assert_stalls_match_tools(result, recorder)


def test_runs_of_one_app_object_get_separate_sandboxes(tmp_path: Path) -> None:
    app = catalog.get_app("tool-agent", latency=FAST, workdir=str(tmp_path))

    async def both() -> list[tc.RunResult]:
        results: list[tc.RunResult] = []

        async def one() -> None:
            results.append(
                await app.run(llm=catalog.scripted_llm("tool-agent"), **catalog.default_inputs("tool-agent"))
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            tg.start_soon(one)
        return results

    results = anyio.run(both)
    roots = {r.output["sandbox"] for r in results}
    assert len(roots) == 2 and all(r.output["fixed"] for r in results)


def test_paper_latency_pads_tools_to_their_published_time() -> None:
    app = catalog.get_app("rag", latency="scaled:0.5")
    result = app.run_sync(llm=catalog.scripted_llm("rag"), **catalog.default_inputs("rag"))
    node = result.nodes["rag"]
    # embed 0.3 s + retrieve 0.8 s, scaled by 0.5
    assert node.tool_s >= 0.55 - 0.02
    assert node.tool_s < 1.5


def test_missing_input_is_named() -> None:
    app = catalog.get_app("rag", latency=FAST)
    with pytest.raises(tc.MissingInput, match="'task'"):
        app.run_sync(llm=catalog.scripted_llm("rag"))
