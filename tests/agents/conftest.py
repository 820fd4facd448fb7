import pytest

import tokencake as tc


@pytest.fixture
def anyio_backend() -> str:
    # trio is not a dependency; the SDK only uses anyio APIs, so asyncio covers the code paths.
    return "asyncio"


async def _agent(ctx, inputs):
    # one LLM request per agent, then its graph-fixed tools, like the published app
    if ctx.app.nodes[ctx.node].kind == "agent":
        await ctx.llm(f"{ctx.node}: work on {sorted(inputs)}")
    for tool in ctx.app.graph.nodes[ctx.node]["calls"]:
        await ctx.call(tool, path=ctx.node)
    return ctx.node


def _tool_fn(path: str = "") -> str:
    return path


def code_writer_app() -> tc.App:
    app = tc.App("code_writer_shape")
    tools = {
        "web_search": {"predict_time": 4.0, "stages": {"query": 0.5, "execute": 1.0, "results": 0.5}},
        "conditional_check": {"predict_time": 0.4},
        "file_write": {"predict_time": 0.1},
        "validate_patch": {"predict_time": 8.0},
        "validate_revision": {"predict_time": 10.0},
        "external_tool_eval": {"predict_time": 4.5},
        "human_confirm": {"predict_time": 3.5},
        "run_tests": {
            "predict_time": 5.5,
            "stages": {"style": 0.5, "compile": 1.0, "functional": 2.0, "report": 1.0},
        },
    }
    for name, opts in tools.items():
        app.add_tool(_tool_fn, name=name, **opts)

    def agent(name: str, tokens: int, after: list[str], calls: tuple[str, ...] = ()) -> None:
        app.add_agent(_agent, name=name, max_tokens=tokens, after=after, calls=list(calls))

    app.add_function(_agent, name="start")
    agent("architect_1", 200, ["start"])
    agent("search_1", 128, ["architect_1"], ("web_search",))
    agent("judger_1", 128, ["search_1"], ("conditional_check",))
    agent("architect_2", 200, ["judger_1"])
    agent("search_2", 128, ["architect_2"], ("web_search",))
    agent("judger_2", 128, ["search_2"], ("conditional_check",))
    agent("file_write_plan", 128, ["judger_2"], ("file_write",))
    for k in (1, 2, 3):
        agent(f"programmer_{k}_validate_patch", 400, ["file_write_plan"], ("validate_patch",))
        agent(f"programmer_{k}_repair", 400, [f"programmer_{k}_validate_patch"])
        agent(f"code_write_{k}", 128, [f"programmer_{k}_repair"], ("file_write",))
    for r in (1, 2):
        agent(f"reviewer_{r}", 200, [f"code_write_{k}" for k in (1, 2, 3)])
    for k in (1, 2):
        agent(f"reviser_{k}_validate_patch", 400, ["reviewer_1", "reviewer_2"], ("validate_revision",))
        agent(f"reviser_{k}_repair", 400, [f"reviser_{k}_validate_patch"])
        agent(f"revised_code_write_{k}", 128, [f"reviser_{k}_repair"], ("file_write",))
    agent("external_eval", 128, ["reviewer_2"], ("external_tool_eval",))
    agent("user_confirm", 128, ["revised_code_write_1", "revised_code_write_2"], ("human_confirm",))
    agent("test_node", 128, ["user_confirm"], ("run_tests",))
    app.add_function(_agent, name="end", after=["test_node", "external_eval"])
    return app


@pytest.fixture
def code_writer() -> tc.App:
    """The Code-Writer-shaped app (see test_graph.py for the expected metadata)."""
    return code_writer_app()
