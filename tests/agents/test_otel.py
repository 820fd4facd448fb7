"""Issue 13, SDK point 4i: OpenTelemetry spans (GenAI semantic conventions), an optional extra."""

import subprocess
import sys

import anyio
import pytest

import tokencake as tc
from tokencake.events import StallBegin

pytestmark = pytest.mark.anyio


@pytest.fixture
def exporter():
    export = pytest.importorskip(
        "opentelemetry.sdk.trace.export.in_memory_span_exporter", reason="needs the otel extra"
    )
    return export.InMemorySpanExporter()


@pytest.fixture
def provider(exporter):
    sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="needs the otel extra")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _app() -> tc.App:
    app = tc.App("traced", inputs=["task"])

    @app.tool(predict_time=0.05, kind="search")
    async def search(q: str) -> str:
        await anyio.sleep(0.05)
        return f"hits for {q}"

    @app.tool()
    def broken() -> str:
        raise tc.ToolError("index offline")

    @app.agent(tools=[search, broken], max_tokens=30, temperature=0.2)
    async def researcher(ctx, inputs):
        return (await ctx.llm(ctx.inputs["task"])).text

    @app.function(after=[researcher])
    def report(ctx, inputs):
        return inputs["researcher"]

    return app


async def test_spans_follow_genai_conventions_and_carry_stall_ids(provider, exporter):
    from opentelemetry.trace import SpanKind, StatusCode

    script = [
        [
            tc.ToolCall(id="call-1", name="search", arguments={"q": "kv"}),
            tc.ToolCall(id="call-2", name="broken"),
        ],
        "done",
    ]
    result = await _app().run(
        {"task": "find"}, llm=tc.ScriptedLLM(script), observer=tc.OTelObserver(tracer_provider=provider)
    )
    all_spans = exporter.get_finished_spans()
    spans = {s.name: s for s in all_spans}
    assert set(spans) == {
        "invoke_workflow traced",
        "invoke_agent researcher",
        "run_function report",
        "chat scripted",
        "execute_tool search",
        "execute_tool broken",
    }
    chats = [s for s in all_spans if s.name == "chat scripted"]
    assert len(chats) == 2 and len(all_spans) == 7  # one chat span per request

    run = spans["invoke_workflow traced"]
    agent = spans["invoke_agent researcher"]
    assert run.parent is None
    assert run.attributes["gen_ai.operation.name"] == "invoke_workflow"
    assert run.attributes["tokencake.run_id"] == result.run_id
    assert agent.parent.span_id == run.context.span_id
    assert agent.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert agent.attributes["gen_ai.agent.name"] == "researcher"
    assert spans["run_function report"].parent.span_id == run.context.span_id

    usage = result.nodes["researcher"].usage
    for chat in chats:
        assert chat.kind == SpanKind.CLIENT and chat.parent.span_id == agent.context.span_id
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.request.model"] == "scripted"
        assert chat.attributes["gen_ai.request.max_tokens"] == 30
        assert chat.attributes["gen_ai.request.temperature"] == 0.2
        assert chat.attributes["gen_ai.conversation.id"] == f"{result.run_id}:researcher"
        assert chat.attributes["server.address"] == "scripted.tokencake.invalid"
    assert sum(c.attributes["gen_ai.usage.input_tokens"] for c in chats) == usage.prompt_tokens
    assert sum(c.attributes["gen_ai.usage.output_tokens"] for c in chats) == usage.completion_tokens
    assert sorted(tuple(c.attributes["gen_ai.response.finish_reasons"]) for c in chats) == [
        ("stop",),
        ("tool_calls",),
    ]

    begins = {e.tool: e for e in result.stall_events if isinstance(e, StallBegin)}
    tool = spans["execute_tool search"]
    assert tool.parent.span_id == agent.context.span_id
    assert tool.attributes["gen_ai.operation.name"] == "execute_tool"
    assert tool.attributes["gen_ai.tool.name"] == "search"
    assert tool.attributes["gen_ai.tool.call.id"] == "call-1"
    assert tool.attributes["tokencake.stall_id"] == begins["search"].stall_id
    assert tool.attributes["tokencake.tool.kind"] == "search"
    assert tool.attributes["tokencake.tool.predicted_s"] == 0.05
    assert tool.status.status_code == StatusCode.UNSET
    assert (tool.end_time - tool.start_time) / 1e9 >= 0.05
    failed = spans["execute_tool broken"]
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.attributes["tokencake.tool.outcome"] == "error"
    assert failed.attributes["tokencake.stall_id"] == begins["broken"].stall_id


async def test_timed_out_run_ends_its_open_spans_with_errors(provider, exporter):
    from opentelemetry.trace import StatusCode

    app = tc.App("slow_trace")

    @app.tool()
    async def wait() -> str:
        await anyio.sleep(5)
        return "x"

    @app.agent(calls=[wait])
    async def agent(ctx, inputs):
        return await ctx.call(wait)

    with pytest.raises(tc.RunTimeout):
        await app.run(
            llm=tc.ScriptedLLM("x"), timeout=0.2, observer=tc.OTelObserver(tracer_provider=provider)
        )
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"invoke_workflow slow_trace", "invoke_agent agent", "execute_tool wait"}
    assert all(s.status.status_code == StatusCode.ERROR for s in spans.values())
    assert spans["execute_tool wait"].attributes["tokencake.tool.outcome"] == "cancelled"


async def test_run_span_joins_the_callers_trace(provider, exporter):
    tracer = provider.get_tracer("test")
    app = _app()
    with tracer.start_as_current_span("request") as outer:
        await app.run(
            {"task": "t"}, llm=tc.ScriptedLLM("done"), observer=tc.OTelObserver(tracer_provider=provider)
        )
    run = next(s for s in exporter.get_finished_spans() if s.name == "invoke_workflow traced")
    assert run.parent.span_id == outer.get_span_context().span_id


def test_the_core_never_imports_opentelemetry():
    code = (
        "import sys, tokencake as tc\n"
        "app = tc.App('x')\n"
        "app.add_function(lambda ctx, inputs: 1, name='f')\n"
        "app.run_sync(llm=tc.ScriptedLLM('x'))\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_without_opentelemetry_the_observer_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # as if opentelemetry-api were missing
    with pytest.raises(ImportError, match=r"pip install 'tokencake\[otel\]'"):
        tc.OTelObserver()
