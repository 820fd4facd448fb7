import itertools
import re

import networkx as nx
import pytest

import tokencake as tc
from tokencake.events import GraphMeta


async def _noop(ctx, inputs):
    return None


def _research_app() -> tc.App:
    app = tc.App("research", inputs=["task"], description="plan, search, write")

    @app.tool(predict_time=4.0, kind="search", timeout=30.0, retries=1)
    def web_search(query: str, k: int = 3) -> list[str]:
        """Search the corpus."""
        return [query] * k

    @app.agent(system="You plan.", max_tokens=200, calls=["web_search"])
    async def planner(ctx, inputs):
        return "plan"

    @app.agent(after=[planner], max_tokens=100, tools=[web_search], importance=2.0, agent_type="writer")
    async def writer(ctx, inputs):
        return "text"

    @app.function(after=["writer"])
    def collect(ctx, inputs):
        return inputs

    return app


def test_decorators_register_nodes_tools_and_graph_metadata():
    app = _research_app()
    assert set(app.nodes) == {"planner", "writer", "collect"}
    assert set(app.tools) == {"web_search"}
    graph = app.graph
    assert isinstance(graph, nx.DiGraph)
    assert set(graph.edges) == {("planner", "writer"), ("writer", "collect")}
    planner = graph.nodes["planner"]
    assert planner["kind"] == "agent"
    assert planner["options"]["system"] == "You plan."
    assert planner["options"]["max_tokens"] == 200
    assert planner["calls"] == ["web_search"]
    assert planner["weight_s"] == pytest.approx(200 * 0.02 + 4.0)
    assert planner["depth"] == 0 and planner["remaining_depth"] == 2
    assert isinstance(planner["meta"], GraphMeta)
    writer = graph.nodes["writer"]
    assert writer["tools"] == ["web_search"]
    assert writer["options"]["agent_type"] == "writer"
    assert writer["options"]["importance"] == 2.0
    assert writer["weight_s"] == pytest.approx(100 * 0.02)  # model-driven tools are not predicted
    assert graph.nodes["collect"]["kind"] == "function"
    assert graph.nodes["collect"]["weight_s"] == 0.0
    assert app.critical_path == ["planner", "writer", "collect"]
    assert app.critical_path_s == pytest.approx(8.0 + 2.0)
    assert app.meta("writer") == app.meta(app.nodes["writer"].fn)
    assert app.sinks == ["collect"]


def test_decorators_return_the_function_unchanged():
    app = tc.App("plain")

    def double(x: int) -> int:
        return 2 * x

    assert app.tool(double) is double
    assert double(3) == 6

    @app.agent
    async def bare(ctx, inputs):
        return 1

    assert app.nodes["bare"].fn is bare


def test_imperative_declaration_and_link():
    app = tc.App("imp")

    def tool_fn(q: str) -> str:
        return q

    async def first(ctx, inputs):
        return 1

    async def second(ctx, inputs):
        return 2

    app.add_tool(tool_fn, name="lookup", predict_time=1.5)
    app.add_agent(first, name="a", max_tokens=10, calls=["lookup"])
    app.add_function(second, name="b", predict_s=0.25)
    app.link("a", "b")
    assert list(app.graph.edges) == [("a", "b")]
    assert app.weight("a") == pytest.approx(10 * 0.02 + 1.5)
    assert app.weight("b") == pytest.approx(0.25)
    assert app.get_tool(tool_fn).name == "lookup"
    with pytest.raises(tc.AppDefinitionError, match="unknown node 'nope'"):
        app.link("a", "nope")


def test_duplicate_names_are_rejected_naming_the_node():
    app = tc.App("dup")
    app.add_agent(_noop, name="worker")
    with pytest.raises(tc.AppDefinitionError, match=r"duplicate name 'worker': already a agent"):
        app.add_function(_noop, name="worker")

    def worker(q: str) -> str:
        return q

    with pytest.raises(tc.AppDefinitionError, match="duplicate name 'worker'"):
        app.add_tool(worker)
    app.add_tool(worker, name="worker_tool")
    with pytest.raises(tc.AppDefinitionError, match="duplicate name 'worker_tool': already a tool"):
        app.add_agent(_noop, name="worker_tool")


def test_unknown_dependencies_and_tools_are_all_named():
    app = tc.App("unknown")
    app.add_agent(_noop, name="a", after=["ghost"])
    app.add_agent(_noop, name="b", calls=["missing_tool"], tools=["other_missing"])

    async def unregistered(ctx, inputs):
        return None

    app.add_agent(_noop, name="c", after=[unregistered])
    with pytest.raises(tc.AppDefinitionError) as info:
        app.validate()
    problems = info.value.problems
    assert "agent 'a' depends on unknown node 'ghost'" in problems
    assert "agent 'b' lists unknown tool 'missing_tool' in calls=" in problems
    assert "agent 'b' lists unknown tool 'other_missing' in tools=" in problems
    assert any("'unregistered' is not a node" in p and "'c'" in p for p in problems)
    assert str(info.value).startswith("4 problems:")


def test_depending_on_a_tool_is_explained():
    app = tc.App("t")

    def search(q: str) -> str:
        return q

    app.add_tool(search)
    app.add_agent(_noop, name="a", after=["search"])
    with pytest.raises(tc.AppDefinitionError, match="depends on 'search', a tool, not a node"):
        app.validate()


def test_cycle_is_printed_as_a_path():
    app = tc.App("cyclic")
    app.add_agent(_noop, name="a", after=["c"])
    app.add_agent(_noop, name="b", after=["a"])
    app.add_agent(_noop, name="c", after=["b"])
    app.add_agent(_noop, name="d", after=["a"])
    with pytest.raises(tc.AppDefinitionError) as info:
        app.graph  # noqa: B018 - building the graph validates
    message = str(info.value)
    match = re.search(r"cycle: (\w+(?: -> \w+)+)", message)
    assert match, message
    nodes = match.group(1).split(" -> ")
    assert nodes[0] == nodes[-1] and len(nodes) == 4
    assert sorted(nodes[:-1]) == ["a", "b", "c"]
    # consecutive entries are real edges a -> b -> c -> a, in that rotation
    edges = {("c", "a"), ("a", "b"), ("b", "c")}
    assert all((x, y) in edges for x, y in itertools.pairwise(nodes))


def test_self_loop_is_a_cycle():
    app = tc.App("self")
    app.add_agent(_noop, name="solo", after=["solo"])
    with pytest.raises(tc.AppDefinitionError, match="cycle: solo -> solo"):
        app.validate()


def test_bad_node_definitions():
    app = tc.App("bad")

    def sync_agent(ctx, inputs):
        return 1

    with pytest.raises(tc.AppDefinitionError, match="agent 'sync_agent' must be an async function"):
        app.agent(sync_agent)

    async def one_arg(ctx):
        return 1

    with pytest.raises(tc.AppDefinitionError, match=r"'one_arg' must accept two arguments \(ctx, inputs\)"):
        app.agent(one_arg)
    with pytest.raises(tc.AppDefinitionError, match="max_tokens"):
        app.add_agent(_noop, name="x", max_tokens=0)
    with pytest.raises(tc.AppDefinitionError, match="has no nodes"):
        tc.App("empty").validate()


def test_graph_cache_is_invalidated_by_changes():
    app = tc.App("grow")
    app.add_agent(_noop, name="a")
    assert app.critical_path == ["a"]
    app.add_agent(_noop, name="b", after=["a"], max_tokens=1000)
    assert app.critical_path == ["a", "b"]
    assert app.meta("a").remaining_depth == 1


def test_run_sync_outside_a_loop_and_missing_inputs():
    app = _research_app()
    llm = tc.ScriptedLLM("ok")
    result = app.run_sync(llm=llm, task="t")
    assert result.output == result.nodes["collect"].output == {"writer": "text"}
    with pytest.raises(tc.MissingInput, match="app 'research' needs input\\(s\\) 'task'"):
        app.run_sync(llm=llm)


@pytest.mark.anyio
async def test_run_sync_inside_a_running_loop_tells_to_await():
    app = _research_app()
    with pytest.raises(RuntimeError, match=r"use `await app\.run\(\.\.\.\)`"):
        app.run_sync(llm=tc.ScriptedLLM("ok"), task="t")
    # ... and the advice works in the same loop
    result = await app.run(llm=tc.ScriptedLLM("ok"), task="t")
    assert result.status == "ok"


def test_stages_that_add_up_to_more_than_a_day_are_refused_at_declaration():
    # Each stage was checked alone, but the hint is their sum: a stall_begin over the wire's
    # limit failed only when the tool was first called, failing its node.
    app = tc.App("t")

    def slow(q: str) -> str:
        return q

    with pytest.raises(tc.AppDefinitionError, match="stages must add up to at most 86400 s"):
        app.add_tool(slow, stages={"queue": 86400, "work": 1})
    app.add_tool(slow, name="ok", stages={"queue": 86400, "work": 1}, predict_time=10.0)  # the hint wins


def test_the_default_agent_type_is_qualified_by_the_app_so_apps_keep_their_own_forecasts():
    """The server learns tool durations per (agent_type, tool): two apps' nodes named alike must
    not share a key unless they say so with agent_type."""
    one, two = tc.App("code-writer"), tc.App("deep-research")
    a = one.add_agent(_noop, name="planner")
    b = two.add_agent(_noop, name="planner")
    c = two.add_agent(_noop, name="critic", agent_type="reviewer")
    assert (a.agent_type, b.agent_type, c.agent_type) == (
        "code-writer.planner",
        "deep-research.planner",
        "reviewer",
    )
    assert a.options()["agent_type"] == "code-writer.planner"
    with pytest.raises(tc.AppDefinitionError, match="exceed 200 characters; set agent_type="):
        tc.App("x" * 150).add_agent(_noop, name="y" * 60)
    tc.App("x" * 150).add_agent(_noop, name="y" * 60, agent_type="short")
