"""Issue 13, SDK point 4h: dynamic fan-out at run time (``template=True`` + ``ctx.fan_out``)."""

import itertools
import time

import anyio
import networkx as nx
import pytest

import tokencake as tc
from tokencake.events import priority_from_graph

pytestmark = pytest.mark.anyio


def _map_app() -> tc.App:
    app = tc.App("fan", inputs=["text"])

    @app.tool(predict_time=0.2)
    async def fetch(part: str) -> str:
        await anyio.sleep(0.2)
        return f"<{part}>"

    @app.agent(template=True, max_tokens=20, calls=[fetch])
    async def summarize(ctx, item):
        doc = await ctx.call(fetch, part=item)
        return (await ctx.llm(f"summarize {doc}")).text

    @app.agent(max_tokens=50)
    async def splitter(ctx, inputs):
        parts = ctx.inputs["text"].split()
        return await ctx.fan_out(summarize, parts)

    @app.function(after=[splitter])
    def join(ctx, inputs):
        return " + ".join(inputs["splitter"])

    return app


async def test_fan_out_runs_instances_concurrently_and_joins_their_outputs_in_order():
    app = _map_app()
    llm = tc.ScriptedLLM(lambda req: req.prompt.upper())
    rec = tc.StallRecorder()
    result = await app.run({"text": "a b c d"}, llm=llm, stall=rec, run_id="r")
    # Run side by side: every instance's tool call began before the first one ended (no wall-clock
    # bound, which a loaded machine breaks).
    kinds = [type(e).__name__ for e in rec.events]
    assert kinds.index("StallEnd") >= 4, kinds
    assert result.output == "SUMMARIZE <A> + SUMMARIZE <B> + SUMMARIZE <C> + SUMMARIZE <D>"
    instances = [f"summarize[{i}]" for i in range(4)]
    assert all(result.nodes[n].status == "ok" for n in instances)
    assert result.nodes["summarize[2]"].output == "SUMMARIZE <C>"
    # each instance is its own agent conversation, with its own stalls
    sessions = {b.session_id for b, _ in rec.pairs()}
    assert sessions == {f"r:{n}" for n in instances}
    by_node = {b["kv_transfer_params"]["tokencake"]["node"]: b for b in llm.requests if "summarize" in str(b)}
    meta = by_node["summarize[0]"]["kv_transfer_params"]["tokencake"]
    parent = app.meta("splitter")
    assert meta["graph"]["depth"] == parent.depth + 1
    assert meta["graph"]["fanout_width"] == 4
    assert meta["graph"]["join_group"] == "splitter"
    assert meta["graph"]["on_critical_path"] == parent.on_critical_path
    assert meta["agent_type"] == "fan.summarize"  # the default type is qualified by the app's name
    assert by_node["summarize[0]"]["priority"] == priority_from_graph(parent)
    assert meta["next_stall"] is None or meta["next_stall"]["tool"] == "fetch"
    # events name the parent and the template
    started = [e for e in result.events if e.kind == "node_started" and e.node in instances]
    assert {(e.data["parent"], e.data["template"]) for e in started} == {("splitter", "summarize")}


async def test_run_graph_holds_the_instances_and_stays_a_sane_dag():
    app = _map_app()
    result = await app.run({"text": "x y"}, llm=tc.ScriptedLLM("s"))
    graph = result.graph
    assert nx.is_directed_acyclic_graph(graph)
    assert set(graph.successors("splitter")) == {"join", "summarize[0]", "summarize[1]"}
    attrs = graph.nodes["summarize[1]"]
    assert attrs["template"] == "summarize" and attrs["parent"] == "splitter"
    assert attrs["kind"] == "agent" and attrs["fanout_width"] == 2 and attrs["depth"] == 1
    assert attrs["weight_s"] == app.weight("summarize")
    # the app's own DAG is untouched: no template, no instances; the sink is still join
    assert set(app.graph.nodes) == {"splitter", "join"}
    assert "summarize" not in app.graph and app.sinks == ["join"]
    assert result.sinks == ["join"]


async def test_fan_out_under_max_concurrency_one_lends_the_parent_slot():
    app = _map_app()
    result = await app.run({"text": "a b c"}, llm=tc.ScriptedLLM("s"), max_concurrency=1)
    spans = sorted(
        (result.nodes[f"summarize[{i}]"].started, result.nodes[f"summarize[{i}]"].finished) for i in range(3)
    )
    assert all(a_end <= b_start + 1e-3 for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    assert result.output.count("s") == 3


async def test_fan_out_max_concurrency_limits_the_instances():
    app = tc.App("limited")
    running, peak = 0, 0

    @app.function(template=True)
    async def work(ctx, item):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await anyio.sleep(0.05)
        running -= 1
        return item * 2

    @app.function()
    async def parent(ctx, inputs):
        return await ctx.fan_out(work, range(6), max_concurrency=2)

    result = await app.run(llm=tc.ScriptedLLM("x"))
    assert result.output == [0, 2, 4, 6, 8, 10] and peak == 2


async def test_failing_instance_cancels_its_siblings_and_fails_the_parent():
    app = tc.App("fan_fail")

    @app.function(template=True)
    async def work(ctx, item):
        if item == "bad":
            await anyio.sleep(0.05)
            raise ValueError("bad item")
        await anyio.sleep(5)
        return item

    @app.function()
    async def parent(ctx, inputs):
        return await ctx.fan_out("work", ["slow", "bad"])

    t0 = time.perf_counter()
    with pytest.raises(tc.NodeFailed) as info:
        await app.run(llm=tc.ScriptedLLM("x"))
    assert time.perf_counter() - t0 < 2
    assert info.value.node == "parent" and isinstance(info.value.__cause__, ValueError)
    nodes = info.value.result.nodes
    assert nodes["work[0]"].status == "cancelled" and nodes["work[1]"].status == "failed"


def test_template_declaration_problems_are_named():
    app = tc.App("tpl")

    @app.function()
    async def root(ctx, inputs):
        return 1

    with pytest.raises(tc.AppDefinitionError, match="template 'child' cannot have after="):
        app.add_function(root, name="child", template=True, after=["root"])

    @app.function(template=True)
    async def item_worker(ctx, item):
        return item

    app.add_function(root, name="depends", after=[item_worker])
    with pytest.raises(tc.AppDefinitionError, match="depends on 'item_worker', a template"):
        app.validate()


async def test_fan_out_to_a_dag_node_is_an_error():
    app = tc.App("not_template")

    @app.function()
    async def other(ctx, inputs):
        return 1

    @app.function()
    async def parent(ctx, inputs):
        return await ctx.fan_out(other, [1])

    with pytest.raises(tc.NodeFailed, match="a DAG node, not a template"):
        await app.run(llm=tc.ScriptedLLM("x"))


@pytest.mark.parametrize("limit", [1, 2])
async def test_fan_outs_started_from_child_tasks_under_max_concurrency(limit: int):
    # The slot used to be borrowed by the node's own task: a fan-out from a child task failed to
    # release it (anyio: "this borrower isn't holding any of this CapacityLimiter's tokens"), and
    # two fan-outs of one node at once took it back twice.
    app = tc.App("two_fan_outs")

    @app.function(template=True)
    async def work(ctx, item):
        await anyio.sleep(0.05)
        return item * 10

    @app.function()
    async def parent(ctx, inputs):
        out: dict[str, list] = {}

        async def run(key: str, items: list[int]) -> None:
            out[key] = await ctx.fan_out(work, items)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "a", [1, 2])
            tg.start_soon(run, "b", [3])
        return out

    @app.function(after=[parent])
    async def after(ctx, inputs):
        return inputs["parent"]

    result = await app.run(llm=tc.ScriptedLLM("x"), max_concurrency=limit)
    assert result.output == {"a": [10, 20], "b": [30]}
