"""examples/transparent/: one agent per framework with no TokenCake import (docs/transparent.md).

The programs import no tokencake module, and each, run as a user runs it (``main`` with a
``--base-url``), is one conversation that transparent mode follows: tc.testing's scripted server
behind ``TransparentMiddleware``, served over loopback HTTP, sees one ``stall_begin`` per tool call,
each ended by the conversation's next request, and every request stamped with one session.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

import tokencake as tc
from tokencake.serving.transparent_asgi import TransparentMiddleware
from tokencake.serving.transparent_events import TransparentConfig

DIR = Path(__file__).resolve().parents[2] / "examples" / "transparent"
#: example file -> the framework it needs
EXAMPLES = {
    "plain_openai": "openai",
    "openai_agents": "agents",
    "langgraph_agent": "langchain.agents",
    "pydantic_ai_agent": "pydantic_ai",
}
FORCED = {"type": "function", "function": {"name": "lookup_order"}}
#: Pydantic AI sends a tool_choice that names every function tool as "required"
FORCED_AS = {"pydantic_ai_agent": "required"}
QUESTIONS = 3


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
            "__import__",
            "import_module",
        ):
            names.update(str(a.value) for a in node.args if isinstance(a, ast.Constant))
    return names


def test_the_examples_import_no_tokencake_module() -> None:
    assert {p.stem for p in DIR.glob("*.py")} == set(EXAMPLES)
    for name in EXAMPLES:
        imported = _imported_modules(DIR / f"{name}.py")
        assert imported, name
        assert not [m for m in imported if m.split(".")[0] == "tokencake"], name


def test_the_import_check_sees_every_form_of_import(tmp_path: Path) -> None:
    for line in (
        "import tokencake",
        "import tokencake.testing as t",
        "from tokencake import testing",
        "from tokencake.serving import Server",
        "importlib.import_module('tokencake.events')",
        "__import__('tokencake')",
    ):
        (tmp_path / "x.py").write_text(line + "\n")
        assert any(m.split(".")[0] == "tokencake" for m in _imported_modules(tmp_path / "x.py")), line


# -- the offline server: transparent mode in front of a scripted model, on loopback HTTP -----------


def _model(req: tc.ScriptedRequest) -> str | tc.ToolCall:
    """A model that calls ``lookup_order`` only when forced (as the bundled 135M model)."""
    choice = req.body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        numbers = re.findall(r"\d+", req.prompt)
        return tc.ToolCall(f"call_{req.index}", "lookup_order", {"order_id": numbers[-1] if numbers else "0"})
    return f"It arrives tomorrow ({', '.join(req.tool_results)})."


class Rig:
    """``TransparentMiddleware`` over ``tc.testing.ScriptedTransport``, its events recorded."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.reset()

    def reset(self) -> None:
        self.events.clear()
        self.model = tc.testing.ScriptedTransport(_model)
        config = TransparentConfig(events_url="http://events.test")
        self.middleware = TransparentMiddleware(
            self._model_app, config, transport=httpx.MockTransport(self._record)
        )

    async def _record(self, request: httpx.Request) -> httpx.Response:
        self.events.append(json.loads(request.content))
        return httpx.Response(200, json={"ok": True, "status": "recorded"})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.middleware(scope, receive, send)

    async def _model_app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        request = httpx.Request(scope["method"], f"http://tokencake.test{scope['path']}", headers=headers)
        request = httpx.Request(request.method, request.url, headers=request.headers, content=body)
        response = await self.model.handle_async_request(request)
        content = await response.aread()
        kept = [(k.encode(), v.encode()) for k, v in response.headers.items() if k.lower() == "content-type"]
        await send({"type": "http.response.start", "status": response.status_code, "headers": kept})
        await send({"type": "http.response.body", "body": content})

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]


@pytest.fixture(scope="module")
def rig() -> Iterator[tuple[Rig, str]]:
    uvicorn = pytest.importorskip("uvicorn")
    app = Rig()
    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the loopback server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield app, f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"tokencake_transparent_example_{name}", DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and typing look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_is_one_followed_conversation_offline(
    name: str, rig: tuple[Rig, str], capsys: pytest.CaptureFixture[str]
) -> None:
    library = EXAMPLES[name]
    pytest.importorskip(library)
    app, base_url = rig
    app.reset()
    module = _load(name)
    module.TOOL_SECONDS = 0.01
    try:
        assert module.main(["--base-url", base_url, "--model", "scripted"]) == 0
    finally:
        sys.modules.pop(module.__name__, None)
        if library == "agents":
            import agents

            agents.set_tracing_disabled(False)  # main() turned it off for the run
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"tool calls: {QUESTIONS}"
    assert len(out) == QUESTIONS + 1 and all(line.startswith("It arrives tomorrow") for line in out[:-1])

    bodies = app.model.requests
    # forced on each question's first request, "none" once the tool answered
    assert [b.get("tool_choice") for b in bodies] == [FORCED_AS.get(name, FORCED), "none"] * QUESTIONS
    metas = [b["kv_transfer_params"]["tokencake"] for b in bodies]
    assert len({m["session_id"] for m in metas}) == 1  # one conversation, recognised every turn
    assert [m["turn"] for m in metas] == list(range(2 * QUESTIONS))
    assert app.middleware.counts["conversations.new"] == 1
    assert app.middleware.counts["conversations.matched"] == 2 * QUESTIONS - 1

    begins, ends = app.of("stall_begin"), app.of("stall_end")
    assert [e["tool"] for e in begins] == ["lookup_order"] * QUESTIONS  # one stall per tool call
    assert [e["stall_id"] for e in ends] == [e["stall_id"] for e in begins]  # each ended
    assert [e["type"] for e in app.events] == ["stall_begin", "stall_end"] * QUESTIONS


def test_the_rig_sees_a_conversation_that_breaks(rig: tuple[Rig, str]) -> None:
    """A client that drops the assistant's tool-call message is a new conversation: the offline
    check above can fail."""
    app, base_url = rig
    app.reset()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Where is order 42?"}]
    tools = [{"type": "function", "function": {"name": "lookup_order", "parameters": {"type": "object"}}}]

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base_url) as client:
            body = {"model": "m", "messages": messages, "tools": tools, "tool_choice": FORCED}
            (await client.post("/chat/completions", json=body)).raise_for_status()
            messages.append({"role": "tool", "tool_call_id": "call_0", "content": "shipped"})
            (await client.post("/chat/completions", json={**body, "tool_choice": "auto"})).raise_for_status()

    asyncio.run(run())
    assert app.middleware.counts["conversations.new"] == 2
    assert len(app.of("stall_begin")) == 1 and app.of("stall_end") == []  # its stall never ends
