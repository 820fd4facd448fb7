"""Issue 13, SDK point 4e: ``ctx.llm(..., output_type=Model)``."""

import httpx
import openai
import pytest
from pydantic import BaseModel

import tokencake as tc

pytestmark = pytest.mark.anyio


class Weather(BaseModel):
    city: str
    temperature_c: float


def _app(**llm_kwargs) -> tc.App:
    app = tc.App("structured")

    @app.agent()
    async def forecaster(ctx, inputs):
        return await ctx.llm("Weather in Oslo?", output_type=Weather, **llm_kwargs)

    return app


async def test_output_type_returns_the_validated_instance_and_asks_for_the_schema():
    llm = tc.ScriptedLLM('{"city": "Oslo", "temperature_c": 4.5}')
    result = await _app().run(llm=llm)
    assert result.output == Weather(city="Oslo", temperature_c=4.5)
    body = llm.requests[0]
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "Weather", "schema": Weather.model_json_schema(), "strict": False},
    }
    prompt = body["messages"][-1]["content"]
    assert prompt.startswith("Weather in Oslo?") and "JSON schema" in prompt and '"temperature_c"' in prompt


async def test_invalid_replies_are_retried_with_the_validation_error():
    llm = tc.ScriptedLLM(
        [
            "Sure! It is cold.",
            '{"city": "Oslo"}',
            'Here you go:\n```json\n{"city": "Oslo", "temperature_c": "4"}\n```',
        ]
    )
    result = await _app().run(llm=llm)
    assert result.output == Weather(city="Oslo", temperature_c=4.0)
    assert len(llm.requests) == 3
    second, third = llm.requests[1]["messages"], llm.requests[2]["messages"]
    assert "not a JSON object" in second[-1]["content"]
    assert "temperature_c: Field required" in third[-1]["content"]
    # the retries continue the same conversation (the invalid reply is in it)
    assert second[-2] == {"role": "assistant", "content": "Sure! It is cold."}
    assert all(
        b["kv_transfer_params"]["tokencake"]["session_id"].endswith(":forecaster") for b in llm.requests
    )
    assert result.nodes["forecaster"].llm_calls == 3


async def test_output_retries_are_bounded():
    llm = tc.ScriptedLLM("no json here")
    with pytest.raises(tc.NodeFailed) as info:
        await _app(output_retries=1).run(llm=llm)
    error = info.value.__cause__
    assert isinstance(error, tc.OutputValidationError) and isinstance(error, ValueError)
    assert error.attempts == 2 and error.text == "no json here" and error.output_type is Weather
    assert "not a JSON object" in error.detail
    assert len(llm.requests) == 2


class _NoResponseFormat(tc.ScriptedLLM):
    """A server that rejects response_format with HTTP 400 (as some OpenAI-compatible servers do)."""

    rejected = 0

    async def _complete(self, body):
        if "response_format" in body:
            self.rejected += 1
            return httpx.Response(400, json={"error": {"message": "response_format is not supported"}})
        return await super()._complete(body)


async def test_server_without_response_format_falls_back_to_instructions():
    app = tc.App("fallback")

    @app.agent()
    async def forecaster(ctx, inputs):
        first = await ctx.llm("Oslo?", output_type=Weather)
        second = await ctx.llm("Bergen?", output_type=Weather)
        return first, second

    llm = _NoResponseFormat(
        ['{"city": "Oslo", "temperature_c": 4}', '{"city": "Bergen", "temperature_c": 7}']
    )
    result = await app.run(llm=llm)
    assert result.output == (Weather(city="Oslo", temperature_c=4), Weather(city="Bergen", temperature_c=7))
    assert llm.rejected == 1 and llm.supports_response_format is False  # asked once, remembered
    assert all("response_format" not in b for b in llm.requests)
    assert all("JSON schema" in b["messages"][-1]["content"] for b in llm.requests)
    failed = [e for e in result.events if e.kind == "llm_failed"]
    assert len(failed) == 1 and failed[0].data["retry_in_s"] == 0.0


async def test_with_tools_the_schema_is_asked_for_in_the_prompt_only():
    app = tc.App("tools_and_output")

    @app.tool()
    def temperature(city: str) -> float:
        return 4.5

    @app.agent(tools=[temperature])
    async def forecaster(ctx, inputs):
        return await ctx.llm("Oslo?", output_type=Weather)

    script = [
        tc.ToolCall(id="t", name="temperature", arguments={"city": "Oslo"}),
        lambda req: f'{{"city": "Oslo", "temperature_c": {req.tool_results[0]}}}',
    ]
    llm = tc.ScriptedLLM(script)
    result = await app.run(llm=llm)
    assert result.output == Weather(city="Oslo", temperature_c=4.5)
    assert all("response_format" not in b for b in llm.requests)  # a schema-bound reply could not call tools


def test_output_type_must_be_a_pydantic_model():
    app = tc.App("bad_output_type")

    @app.agent()
    async def agent(ctx, inputs):
        return await ctx.llm("x", output_type=dict)

    with pytest.raises(tc.NodeFailed, match="pydantic BaseModel"):
        app.run_sync(llm=tc.ScriptedLLM("{}"))


class _Always400(tc.ScriptedLLM):
    async def _complete(self, body):
        self.requests.append(body)
        return httpx.Response(400, json={"error": {"message": "prompt too long"}})


async def test_an_unrelated_400_does_not_switch_response_format_off():
    llm = _Always400("unused")
    with pytest.raises(tc.NodeFailed) as info:
        await _app().run(llm=llm)
    assert isinstance(info.value.__cause__, openai.BadRequestError)
    assert [("response_format" in b) for b in llm.requests] == [True, False]  # one try without it
    assert llm.supports_response_format is True  # that did not help, so it is not remembered
