import json

import pytest

import tokencake as tc
from tokencake.events import StallBegin

pytestmark = pytest.mark.anyio


def _calc_app(**agent_opts) -> tc.App:
    app = tc.App("calc")

    @app.tool(predict_time=0.5, kind="math")
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @app.tool(predict_time=0.5, kind="math")
    async def mul(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    @app.tool()
    def lookup(key: str) -> str:
        if key == "missing":
            raise tc.ToolError(f"no entry {key!r}")
        raise RuntimeError("database on fire")

    agent_opts.setdefault("tools", [add, mul])

    @app.agent(system="You compute.", **agent_opts)
    async def solver(ctx, inputs):
        reply = await ctx.llm("What is (2 + 3) * 4?")
        return {"text": reply.text, "turns": reply.turns, "usage": reply.usage, "messages": ctx.messages}

    return app


def _tool_messages(body: dict) -> list[dict]:
    return [m for m in body["messages"] if m["role"] == "tool"]


async def test_model_driven_loop_calls_two_tools_and_finishes_within_max_turns():
    script = [
        tc.ToolCall(name="add", arguments={"a": 2, "b": 3}),
        tc.ToolCall(name="mul", arguments={"a": 5, "b": 4}),
        "The answer is 20.",
    ]
    llm = tc.ScriptedLLM(script)
    rec = tc.StallRecorder()
    result = await _calc_app().run(llm=llm, stall=rec, run_id="r")
    out = result.output
    assert out["text"] == "The answer is 20." and out["turns"] == 3
    assert len(llm.requests) == 3
    # both tools were offered with their schemas, and the last allowed turn forbids more tool calls
    names = [t["function"]["name"] for t in llm.requests[0]["tools"]]
    assert names == ["add", "mul"]
    assert llm.requests[0]["tools"][0]["function"]["description"] == "Add two integers."
    assert "tool_choice" not in llm.requests[0]
    assert _tool_messages(llm.requests[1]) == [
        {
            "role": "tool",
            "tool_call_id": llm.requests[1]["messages"][2]["tool_calls"][0]["id"],
            "content": "5",
        }
    ]
    assert _tool_messages(llm.requests[2])[-1]["content"] == "20"
    # each model-chosen tool execution is stall-wrapped, in the same session as the LLM turns
    begins = [e for e in rec.events if isinstance(e, StallBegin)]
    assert [(b.tool, b.kind, b.session_id) for b in begins] == [
        ("add", "math", "r:solver"),
        ("mul", "math", "r:solver"),
    ]
    assert [e.type for e in rec.events] == ["stall_begin", "stall_end"] * 2
    node = result.nodes["solver"]
    assert node.llm_calls == 3 and node.tool_calls == 2
    assert out["usage"] == node.usage  # the reply's usage covers the whole loop
    turns = [r["kv_transfer_params"]["tokencake"]["turn"] for r in llm.requests]
    assert turns == [0, 1, 2]


async def test_last_allowed_turn_sets_tool_choice_none_and_overrun_fails():
    llm = tc.ScriptedLLM(lambda req: tc.ToolCall(name="add", arguments={"a": 1, "b": 1}))
    with pytest.raises(tc.NodeFailed) as info:
        await _calc_app().run(llm=llm, run_id="r")
    assert isinstance(info.value.__cause__, tc.ToolError)
    assert "max_turns=8" in str(info.value.__cause__)
    assert len(llm.requests) == 8
    assert llm.requests[-1]["tool_choice"] == "none"
    assert all("tool_choice" not in r for r in llm.requests[:-1])


async def test_bad_arguments_and_unknown_tools_go_back_to_the_model():
    script = [
        [
            tc.ToolCall(name="add", arguments={"a": "two", "b": 3}),
            tc.ToolCall(name="divide", arguments={"a": 1}),
            {"name": "mul", "arguments": {"a": 2, "b": 3}},
        ],
        "done",
    ]
    llm = tc.ScriptedLLM(script)
    rec = tc.StallRecorder()
    result = await _calc_app().run(llm=llm, stall=rec)
    assert result.output["text"] == "done"
    replies = [m["content"] for m in _tool_messages(llm.requests[1])]
    assert replies[0] == (
        "error: invalid arguments for tool 'add': "
        "a: Input should be a valid integer, unable to parse string as an integer"
    )
    assert replies[1].startswith("error: unknown tool 'divide'; available tools: add, mul")
    assert replies[2] == "6"
    assert len(rec.events) == 2  # only the valid call ran (and stalled)


async def test_invalid_json_arguments_go_back_to_the_model():
    def reply(req):
        if req.turn == 0:
            return {"tool_calls": [tc.ToolCall(name="add", raw_arguments="{not json")]}
        return req.tool_results[0]

    llm = tc.ScriptedLLM(reply)
    result = await _calc_app().run(llm=llm)
    assert result.output["text"].startswith("error: arguments for 'add' must be a JSON object")


async def test_tool_error_is_told_to_the_model_other_exceptions_fail_the_node():
    llm = tc.ScriptedLLM([tc.ToolCall(name="lookup", arguments={"key": "missing"}), "sorry"])
    result = await _calc_app(tools=["lookup"]).run(llm=llm)
    assert result.output["text"] == "sorry"
    assert _tool_messages(llm.requests[1])[0]["content"] == "error: no entry 'missing'"

    llm = tc.ScriptedLLM([tc.ToolCall(name="lookup", arguments={"key": "x"}), "unreachable"])
    with pytest.raises(tc.NodeFailed) as info:
        await _calc_app(tools=["lookup"]).run(llm=llm)
    assert info.value.node == "solver"
    assert isinstance(info.value.__cause__, RuntimeError) and "database on fire" in str(info.value.__cause__)


async def test_graph_fixed_call_validates_and_names_the_tool():
    app = tc.App("fixed")

    @app.tool()
    def add(a: int, b: int) -> int:
        return a + b

    @app.agent()
    async def user(ctx, inputs):
        assert await ctx.call("add", a=1, b=2) == 3
        with pytest.raises(tc.ToolError, match="'nope' is not a tool of app 'fixed'"):
            await ctx.call("nope")
        await ctx.call(add, a="x", b=2)

    rec = tc.StallRecorder()
    with pytest.raises(tc.NodeFailed) as info:
        await app.run(llm=tc.ScriptedLLM("x"), stall=rec)
    cause = info.value.__cause__
    assert isinstance(cause, tc.ToolArgumentsError) and cause.tool == "add"
    assert "invalid arguments for tool 'add': a:" in str(cause)
    assert len(rec.events) == 2  # the invalid call never ran


async def test_tool_results_are_serialized_for_the_model():
    app = tc.App("serialize")

    @app.tool()
    def info(n: int) -> dict:
        return {"n": n, "items": [1, 2], "note": "ü"}

    @app.agent(tools=[info])
    async def agent(ctx, inputs):
        return (await ctx.llm("go", max_turns=2)).text

    llm = tc.ScriptedLLM([tc.ToolCall(name="info", arguments={"n": 3}), "ok"])
    await app.run(llm=llm)
    content = _tool_messages(llm.requests[1])[0]["content"]
    assert json.loads(content) == {"n": 3, "items": [1, 2], "note": "ü"}
    assert llm.requests[1]["tool_choice"] == "none"
    assert llm.requests[0]["kv_transfer_params"]["tokencake"]["next_stall"]["tool"] == "info"
    # The last turn cannot call a tool: it announces none (a stall that would never end).
    assert llm.requests[1]["kv_transfer_params"]["tokencake"].get("next_stall") is None


async def test_node_extra_body_goes_into_every_call_and_a_calls_own_keys_win():
    app = tc.App("sampling")

    @app.agent(temperature=0.0, extra_body={"repetition_penalty": 1.1, "top_k": 5})
    async def writer(ctx, inputs):
        await ctx.llm("first")
        return await ctx.llm("second", extra_body={"top_k": 1})

    llm = tc.ScriptedLLM(["ok", "ok"])
    await app.run(llm=llm)
    first, second = llm.requests
    assert (first["repetition_penalty"], first["top_k"]) == (1.1, 5)
    assert (second["repetition_penalty"], second["top_k"]) == (1.1, 1)
    assert app.nodes["writer"].options()["extra_body"] == {"repetition_penalty": 1.1, "top_k": 5}


def test_node_extra_body_must_be_a_mapping():
    app = tc.App("bad")
    with pytest.raises(tc.AppDefinitionError, match="extra_body must be a mapping"):

        @app.agent(extra_body=["repetition_penalty"])
        async def writer(ctx, inputs):
            return None
