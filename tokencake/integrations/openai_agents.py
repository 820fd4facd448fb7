"""TokenCake for the OpenAI Agents SDK (``pip install 'tokencake[openai-agents]'``).

:func:`instrument` returns a copy of an ``agents.Agent`` that a TokenCake server can help: its
model is an ``OpenAIChatCompletionsModel`` over ``tc.openai_client(session)``, so every chat
completion of the conversation carries the session's metadata, and each ``FunctionTool`` runs
inside ``tc.stall``. The SDK's ``RunHooks.on_tool_end`` is not called when a tool is cancelled, so
the stall wraps the tool's ``on_invoke_tool`` itself: its end is sent on success, error, timeout
and cancellation alike.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import openai
from agents import Agent, FunctionTool, Handoff, Model, OpenAIChatCompletionsModel, RunContextWrapper
from agents.tool_context import ToolContext

import tokencake as tc

from ._stalls import Kind, PredictedS, tool_stall

__all__ = ["SessionSource", "instrument", "stall_tool"]

#: A session, or a function returning the current one (None: send requests and run tools unchanged).
SessionSource = tc.Session | Callable[[], tc.Session | None]


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
    ``tc.openai_client(session, base_url=..., api_key=...)``). Agents reached by handoff are
    instrumented the same way and share the session: a handoff continues the conversation.
    ``predicted_s`` / ``kind`` describe the tools (one value, or per tool name). Tools of MCP
    servers are listed at run time and are not bracketed; an ``Agent.as_tool`` is bracketed as a
    tool of this agent (its own requests belong to whatever session it was instrumented with).
    The original agent is left unchanged.
    """
    _check_source(session)
    if client is None:
        client = tc.openai_client(session, base_url=base_url, api_key=api_key)
    memo: dict[int, Agent[Any]] = {}

    def copy_agent(original: Agent[Any]) -> Agent[Any]:
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
            stall_tool(t, session, predicted_s=predicted_s, kind=kind) if isinstance(t, FunctionTool) else t
            for t in original.tools
        ]
        clone = original.clone(
            model=OpenAIChatCompletionsModel(model=name, openai_client=client), tools=tools
        )
        memo[id(original)] = clone  # before the handoffs: agents may hand off to each other
        clone.handoffs = [
            copy_agent(h) if isinstance(h, Agent) else _handoff(h, copy_agent) for h in original.handoffs
        ]
        return clone

    return copy_agent(agent)


def stall_tool(
    tool: FunctionTool, session: SessionSource, *, predicted_s: PredictedS = None, kind: Kind = "tool"
) -> FunctionTool:
    """A copy of ``tool`` whose every invocation is bracketed by ``stall_begin`` / ``stall_end``.

    The end is sent also when the tool raises, times out (``timeout_seconds``) or is cancelled.
    Errors the SDK turns into a message for the model (the default ``failure_error_function``)
    happen inside the tool's invoker, so their stall ends with outcome ``ok``.
    """
    _check_source(session)
    invoke_inner = tool.on_invoke_tool
    name = tool.name

    async def on_invoke_tool(ctx: ToolContext[Any], arguments: str) -> Any:
        current = _current(session)
        if current is None:
            return await invoke_inner(ctx, arguments)
        async with tool_stall(current, name, predicted_s=predicted_s, kind=kind):
            return await invoke_inner(ctx, arguments)

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


def _current(session: SessionSource) -> tc.Session | None:
    return session if isinstance(session, tc.Session) else session()


def _check_source(session: SessionSource) -> None:
    if not (isinstance(session, tc.Session) or callable(session)):
        raise TypeError(f"session must be a tc.Session or a function returning one, got {session!r}")
