import time

import openai
import pytest

import tokencake as tc
from tokencake.agents._scripted import count_tokens

pytestmark = pytest.mark.anyio


async def _chat(llm: tc.LLM, text: str, **kwargs) -> tc.LLMReply:
    return await llm.chat([{"role": "user", "content": text}], **kwargs)


async def test_list_script_is_consumed_in_order_and_then_fails_clearly():
    llm = tc.ScriptedLLM(["first", tc.ToolCall(name="t", arguments={"a": 1})])
    assert (await _chat(llm, "q")).text == "first"
    reply = await _chat(llm, "q")
    assert reply.text == "" and reply.finish_reason == "tool_calls"
    assert reply.tool_calls[0].name == "t" and reply.tool_calls[0].arguments == {"a": 1}
    assert reply.tool_calls[0].id.startswith("call_")
    with pytest.raises(openai.BadRequestError, match="no reply left"):
        await _chat(llm, "q")
    assert len(llm.requests) == 3


async def test_dict_script_by_node_with_fallback():
    app = tc.App("by_node")

    @app.agent()
    async def alpha(ctx, inputs):
        return [(await ctx.llm("1")).text, (await ctx.llm("2")).text]

    @app.agent()
    async def beta(ctx, inputs):
        return (await ctx.llm("3")).text

    llm = tc.ScriptedLLM({"alpha": ["a1", "a2"], "*": lambda req: f"fallback for {req.node}"})
    result = await app.run(llm=llm)
    assert result.outputs == {"alpha": ["a1", "a2"], "beta": "fallback for beta"}
    with pytest.raises(tc.NodeFailed, match="no script for node 'beta'"):
        await app.run(llm=tc.ScriptedLLM({"alpha": "same"}))


async def test_callable_sees_the_request():
    seen: list[tc.ScriptedRequest] = []

    def reply(req: tc.ScriptedRequest) -> dict:
        seen.append(req)
        return {"content": "calling", "tool_calls": [{"name": "lookup", "arguments": {"q": req.prompt}}]}

    llm = tc.ScriptedLLM(reply, model="m1")
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    out = await _chat(llm, "find cake", tools=tools)
    assert out.text == "calling" and out.tool_calls[0].arguments == {"q": "find cake"}
    assert out.model == "m1"
    req = seen[0]
    assert req.tools == ["lookup"] and req.index == 0 and req.node == "" and req.prompt == "find cake"


async def test_usage_is_deterministic_and_max_tokens_truncates():
    assert count_tokens("two words") == 2
    assert count_tokens("a-very-long-hyphenated-word") == 4  # 27 characters -> ceil(27 / 8)
    assert count_tokens("") == 0
    llm = tc.ScriptedLLM("one two three four five")
    reply = await _chat(llm, "hello there")
    # prompt: 4 per message + 2 words; completion: 5 words
    assert reply.usage == tc.Usage(6, 5, 11)
    assert reply.finish_reason == "stop"
    cut = await _chat(llm, "hello there", max_tokens=2)
    assert cut.text == "one two" and cut.finish_reason == "length"
    assert cut.usage.completion_tokens == 2


async def test_token_delay_simulates_decoding_time():
    llm = tc.ScriptedLLM("a b c d e", token_delay=0.02)
    t0 = time.perf_counter()
    reply = await _chat(llm, "x")
    assert time.perf_counter() - t0 >= 0.1
    assert reply.latency_s >= 0.1


async def test_models_endpoint_streaming_and_unknown_paths():
    llm = tc.ScriptedLLM("x", model="tiny")
    page = await llm.client.models.list()
    assert [m.id for m in page.data] == ["tiny"]
    assert await llm.resolve_model() == "tiny"
    # streamed chat completions are server-sent chunks (the openai client parses them)
    stream = await llm.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "x"
    assert chunks[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.NotFoundError):
        await llm.client.completions.create(model="tiny", prompt="x")
    assert len(llm.requests) == 1  # only chat completions are recorded
    await llm.aclose()


async def test_bad_reply_type_is_reported():
    llm = tc.ScriptedLLM(lambda req: 42)
    with pytest.raises(Exception, match="reply must be str, ToolCall, list or dict"):
        await _chat(llm, "x")


def test_tool_call_needs_a_name():
    with pytest.raises(ValueError, match="name"):
        tc.ToolCall(id="1")
