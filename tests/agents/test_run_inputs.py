"""Issue 13, SDK point 4a: run keywords are checked, inputs are unambiguous, unreachable servers are named."""

import socket

import openai
import pytest

import tokencake as tc

pytestmark = pytest.mark.anyio


def _echo_app() -> tc.App:
    app = tc.App("echo", inputs=["task"])

    @app.function()
    def only(ctx, inputs):
        return dict(ctx.inputs)

    return app


@pytest.mark.parametrize(
    ("kwargs", "bad", "suggestion"),
    [
        ({"lllm": None}, "lllm", "llm"),
        ({"timout": 5}, "timout", "timeout"),
        ({"observr": print}, "observr", "observer"),
        ({"max_concurency": 2}, "max_concurency", "max_concurrency"),
        ({"tsk": "t"}, "tsk", "task"),  # a misspelt declared input
    ],
)
def test_misspelt_keyword_names_itself_and_the_close_match(kwargs, bad, suggestion):
    app = _echo_app()
    args = {"task": "t", **kwargs} if bad != "tsk" else kwargs
    with pytest.raises(TypeError) as info:
        app.run_sync(llm=tc.ScriptedLLM("x"), **args)
    message = str(info.value)
    assert f"unexpected keyword argument {bad!r}" in message
    assert f"did you mean {suggestion}=?" in message
    assert "App.run_sync()" in message


def test_unknown_keyword_without_a_close_match_explains_the_mapping():
    with pytest.raises(TypeError) as info:
        _echo_app().run_sync(task="t", llm=tc.ScriptedLLM("x"), zebra=1)
    message = str(info.value)
    assert "did you mean" not in message
    assert "declared inputs of app 'echo': task" in message
    assert "app.run_sync({'zebra': ...})" in message


async def test_run_and_stream_check_keywords_before_starting():
    app = _echo_app()
    llm = tc.ScriptedLLM("x")
    with pytest.raises(TypeError, match=r"App\.run\(\) .*'lllm'.*did you mean llm=\?"):
        await app.run(task="t", lllm=llm)
    with pytest.raises(TypeError, match=r"App\.stream\(\) .*'lllm'"):
        app.stream(task="t", lllm=llm)  # raised at the call, before `async with`
    with pytest.raises(tc.MissingInput):
        app.stream(llm=llm)


def test_inputs_mapping_carries_undeclared_and_option_named_inputs():
    app = _echo_app()
    llm = tc.ScriptedLLM("x")
    given = {"task": "t", "timeout": "an input, not the option", "extra": 1}
    result = app.run_sync(given, llm=llm)
    assert result.output == given
    # declared inputs as keywords keep working (the old spelling)
    assert app.run_sync(llm=llm, task="kw").output == {"task": "kw"}
    assert app.run_sync({"extra": 2}, llm=llm, task="both").output == {"extra": 2, "task": "both"}
    with pytest.raises(TypeError, match="twice"):
        app.run_sync({"task": "a"}, task="b", llm=llm)
    with pytest.raises(TypeError, match="as a mapping"):
        app.run_sync(["task"], llm=llm)


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_unreachable_server_error_names_the_url():
    url = f"http://127.0.0.1:{_unused_port()}/v1"
    app = tc.App("offline")

    @app.agent()
    async def asker(ctx, inputs):
        return (await ctx.llm("hi")).text

    llm = tc.LLM(url, model="m", max_retries=0, events_url=False)
    with pytest.raises(tc.NodeFailed) as info:
        await app.run(llm=llm)
    cause = info.value.__cause__
    assert isinstance(cause, tc.LLMConnectionError)
    assert isinstance(cause, openai.APIConnectionError)  # existing except clauses still match
    assert cause.url == url
    assert url in str(cause) and url in str(info.value)
    assert "TOKENCAKE_BASE_URL" in str(cause)


async def test_default_llm_unreachable_names_the_url(monkeypatch):
    """The issue's case: no llm= given, the default LLM() finds no server."""
    url = f"http://127.0.0.1:{_unused_port()}/v1"
    monkeypatch.setenv("TOKENCAKE_BASE_URL", url)
    monkeypatch.delenv("TOKENCAKE_MODEL", raising=False)
    monkeypatch.delenv("TOKENCAKE_EVENTS_URL", raising=False)
    app = tc.App("default_llm")

    @app.agent()
    async def asker(ctx, inputs):
        return (await ctx.llm("hi")).text

    with pytest.raises(tc.NodeFailed) as info:
        await app.run()
    assert isinstance(info.value.__cause__, tc.LLMConnectionError)  # from GET /v1/models
    assert url in str(info.value)
