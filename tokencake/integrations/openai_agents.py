"""TokenCake for the OpenAI Agents SDK (``pip install 'tokencake[openai-agents]'``).

:func:`instrument` returns a copy of an ``agents.Agent`` that a TokenCake server can help: its
model is an ``OpenAIChatCompletionsModel`` over ``tc.openai_client(session)``, so every chat
completion of the conversation carries the session's metadata, and each ``FunctionTool`` runs
inside ``tc.stall``. The SDK's ``RunHooks.on_tool_end`` is not called when a tool is cancelled, so
the stall wraps the tool's ``on_invoke_tool`` itself: its end is sent on success, error, timeout
and cancellation alike. What the server did with the KV during each tool call appears in the
run's trace as a ``tokencake.kv`` custom span under the tool call's span.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import openai
from agents import Agent, FunctionTool, Handoff, Model, OpenAIChatCompletionsModel, RunContextWrapper
from agents.tool_context import ToolContext
from agents.tracing import custom_span, get_current_span
from openai.types.chat import ChatCompletion

import tokencake as tc

from ._kv import Resumes, ToolCallRef, provenance
from ._stalls import Kind, PredictedS, StampCheck, tool_stall

__all__ = ["SessionSource", "instrument", "stall_tool"]

#: A session, or a function returning the current one (None: send requests and run tools unchanged).
SessionSource = tc.Session | Callable[[], tc.Session | None]

#: A tool cancelled this close to its ``timeout_seconds`` was cancelled by the SDK's timeout.
_TIMER_SLACK_S = time.get_clock_info("monotonic").resolution + 1e-3

_CLIENT_FIX = (
    "Leave instrument()'s client= out (it builds tc.openai_client(session)), or build that client "
    "with tc.openai_client(session, base_url=..., api_key=...)."
)
_RUN_CONFIG_FIX = (
    "RunConfig(model=...) replaces the instrumented agents' model: leave it unset "
    "(instrument(..., model=...) names the served model), or build that model over tc.openai_client(session)."
)


class _Link:
    """What the copies made by one :func:`instrument` call share: the session source, the chat
    server's URL, the warning for unstamped requests, and the tool calls awaiting their next turn."""

    def __init__(self, session: SessionSource, chat_url: str | None) -> None:
        self.session = session
        self.chat_url = chat_url
        self.check = StampCheck(_CLIENT_FIX)
        self.resumes = Resumes()

    def current(self) -> tc.Session | None:
        return self.session if isinstance(self.session, tc.Session) else self.session()

    def response(self, session: tc.Session, completion: ChatCompletion) -> None:
        """Attach the server's provenance of ``completion`` to the tool calls it resumed."""
        extra = getattr(completion, "model_extra", None) or {}
        usage = completion.usage
        resumed = self.resumes.resumed(
            session.session_id,
            provenance(extra.get("kv_transfer_params")),
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
        )
        for call, report in resumed:
            with custom_span("tokencake.kv", data=report, parent=call.span):
                pass


class _Model(OpenAIChatCompletionsModel):
    """The instrumented agents' model: points the session at the chat server, warns once when the
    client sends no TokenCake metadata, and reads each response's KV provenance."""

    def __init__(self, model: str, client: openai.AsyncOpenAI, link: _Link) -> None:
        super().__init__(model=model, openai_client=client)
        self.link = link

    def _begin(self) -> tuple[tc.Session | None, int]:
        session = self.link.current()
        if session is not None and self.link.chat_url:
            session.use_server(self.link.chat_url)
        return session, session.turn if session is not None else 0

    def _end(self, session: tc.Session | None, turn: int) -> None:
        if session is not None and session.turn == turn:
            self.link.check.warn(
                f"instrument(): the requests of session {session.session_id!r} carry no TokenCake "
                f"metadata (its client does not stamp them). {_CLIENT_FIX}"
            )

    async def get_response(self, *args: Any, **kwargs: Any) -> Any:
        session, turn = self._begin()
        response = await super().get_response(*args, **kwargs)
        self._end(session, turn)
        return response

    async def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        session, turn = self._begin()
        async for event in super().stream_response(*args, **kwargs):
            yield event
        self._end(session, turn)
        if session is not None:  # a streamed reply carries no provenance: its tool calls get none
            self.link.resumes.resumed(session.session_id, None, prompt_tokens=0, completion_tokens=0)

    async def _fetch_response(self, *args: Any, **kwargs: Any) -> Any:
        # The one place the SDK holds the raw completion (its vendor fields). Should an SDK
        # release rename it, the KV reports stop and nothing else changes.
        result = await super()._fetch_response(*args, **kwargs)
        session = self.link.current()
        if isinstance(result, ChatCompletion) and session is not None:
            self.link.response(session, result)
        return result


def instrument(
    agent: Agent[Any],
    session: SessionSource,
    *,
    model: str | None = None,
    client: openai.AsyncOpenAI | None = None,
    base_url: str | None = None,
    api_key: str | None = None,
    predicted_s: PredictedS = None,
    kind: Kind = "tool",
) -> Agent[Any]:
    """A copy of ``agent`` whose requests and tool calls belong to ``session``.

    ``session`` is one agent conversation: reuse the instrumented agent for every turn of it. For
    one agent object serving many conversations, pass a function returning the current session
    (e.g. a ``ContextVar.get``) and share the result. The model is ``model`` or the agent's own
    model name (else ``$TOKENCAKE_MODEL``), served through ``client`` (default:
    ``tc.openai_client(session, base_url=..., api_key=...)``); the chat server's URL (``base_url``,
    else the client's) becomes the session's server (``tc.Session.use_server``), so its stall
    events follow. A client that sends no TokenCake metadata gets a ``RuntimeWarning`` at its first
    request. Agents reached by handoff are instrumented the same way and share the session (a
    handoff continues the conversation); their stalls name them as ``node`` / ``agent_type``.
    ``predicted_s`` / ``kind`` describe the tools (one value, or per tool name). Tools of MCP
    servers are listed at run time and are not bracketed; an ``Agent.as_tool`` is bracketed as a
    tool of this agent (its own requests belong to whatever session it was instrumented with).
    The original agent is left unchanged.
    """
    _check_source(session)
    chat_url = base_url or (str(client.base_url) if client is not None else None)
    if isinstance(session, tc.Session) and chat_url:
        session.use_server(chat_url)
    if client is None:
        client = tc.openai_client(session, base_url=base_url, api_key=api_key)
    link = _Link(session, chat_url or str(client.base_url))
    memo: dict[int, Agent[Any]] = {}

    def copy_agent(original: Agent[Any], label: str | None) -> Agent[Any]:
        if id(original) in memo:
            return memo[id(original)]
        name = model or (original.model if isinstance(original.model, str) else None)
        name = name or os.environ.get("TOKENCAKE_MODEL")
        if not name:
            what = "a Model object" if isinstance(original.model, Model) else "no model name"
            raise ValueError(
                f"agent {original.name!r} has {what}; pass instrument(..., model='<served model name>') "
                "or set TOKENCAKE_MODEL"
            )
        tools = [
            _wrap_tool(t, link, predicted_s=predicted_s, kind=kind, agent=label)
            if isinstance(t, FunctionTool)
            else t
            for t in original.tools
        ]
        clone = original.clone(model=_Model(name, client, link), tools=tools)
        memo[id(original)] = clone  # before the handoffs: agents may hand off to each other

        def target(a: Agent[Any]) -> Agent[Any]:
            return copy_agent(a, None if a is agent else a.name)

        clone.handoffs = [
            target(h) if isinstance(h, Agent) else _handoff(h, target) for h in original.handoffs
        ]
        return clone

    return copy_agent(agent, None)


def stall_tool(
    tool: FunctionTool, session: SessionSource, *, predicted_s: PredictedS = None, kind: Kind = "tool"
) -> FunctionTool:
    """A copy of ``tool`` whose every invocation is bracketed by ``stall_begin`` / ``stall_end``.

    The end is sent also when the tool raises, times out (``timeout_seconds``: outcome
    ``timeout``) or is cancelled. Errors the SDK turns into a message for the model (the default
    ``failure_error_function``) happen inside the tool's invoker, so their stall ends with outcome
    ``ok``.
    """
    _check_source(session)
    return _wrap_tool(tool, _Link(session, None), predicted_s=predicted_s, kind=kind, agent=None)


def _wrap_tool(
    tool: FunctionTool, link: _Link, *, predicted_s: PredictedS, kind: Kind, agent: str | None
) -> FunctionTool:
    invoke_inner = tool.on_invoke_tool
    name = tool.name
    timeout_s = tool.timeout_seconds

    async def invoke(ctx: ToolContext[Any], arguments: str, started: float) -> Any:
        current = link.current()
        if current is None:
            return await invoke_inner(ctx, arguments)
        run_config = getattr(ctx, "run_config", None)
        overridden = getattr(run_config, "model", None) is not None
        link.check.check(current, _RUN_CONFIG_FIX if overridden else None)
        scope = tool_stall(current, name, predicted_s=predicted_s, kind=kind, agent=agent)
        span = get_current_span()  # the SDK's span of this tool call
        try:
            async with scope:
                try:
                    return await invoke_inner(ctx, arguments)
                except asyncio.CancelledError:
                    now = asyncio.get_running_loop().time()
                    if timeout_s is not None and now >= started + timeout_s - _TIMER_SLACK_S:
                        scope.fail("timeout", f"ToolTimeoutError: {name} timed out after {timeout_s:g} s")
                    raise
        finally:
            if scope.outcome != "cancelled":  # the run goes on: the next turn resumes it
                call_id = getattr(ctx, "tool_call_id", None)
                link.resumes.ended(ToolCallRef(current.session_id, name, scope.stall_id, call_id, span))

    def on_invoke_tool(ctx: ToolContext[Any], arguments: str) -> Awaitable[Any]:
        # A plain function: the start is taken when the SDK creates the call, before its
        # timeout (``asyncio.wait_for``) starts counting, so a cancellation at that deadline is
        # told apart from the run being cancelled.
        return invoke(ctx, arguments, asyncio.get_running_loop().time())

    wrapped = copy.copy(tool)
    wrapped.on_invoke_tool = on_invoke_tool
    return wrapped


def _handoff(handoff: Handoff[Any, Any], copy_agent: Callable[[Agent[Any]], Agent[Any]]) -> Handoff[Any, Any]:
    """``handoff`` whose target agent is instrumented when the handoff happens."""
    invoke_inner = handoff.on_invoke_handoff

    async def on_invoke_handoff(ctx: RunContextWrapper[Any], arguments: str) -> Agent[Any]:
        return copy_agent(await invoke_inner(ctx, arguments))

    wrapped = copy.copy(handoff)
    wrapped.on_invoke_handoff = on_invoke_handoff
    return wrapped


def _check_source(session: SessionSource) -> None:
    if not (isinstance(session, tc.Session) or callable(session)):
        raise TypeError(f"session must be a tc.Session or a function returning one, got {session!r}")
