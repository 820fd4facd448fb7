"""TokenCake for Pydantic AI (``pip install 'tokencake[pydantic-ai]'``).

:class:`TokenCake` is a capability: ``Agent(model, tools=[...], capabilities=[TokenCake()])``. It
adds the conversation's TokenCake fields to every model request (``extra_body``, so it works with
any OpenAI-compatible model the agent already has) and wraps the agent's toolset in
:class:`TokenCakeToolset`, which runs every tool call inside ``tc.stall``. Sessions are keyed by
Pydantic AI's ``conversation_id`` (stable across runs that continue a ``message_history``) and the
agent's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pydantic_ai import RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.models import ModelRequestContext
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset

import tokencake as tc
from tokencake.events import NextStall

from ._metadata import with_metadata
from ._sessions import Sessions
from ._stalls import Kind, PredictedS, tool_stall

__all__ = ["TokenCake", "TokenCakeToolset"]


class TokenCake(AbstractCapability[Any]):
    """Capability that gives each (conversation, agent) of a Pydantic AI agent a TokenCake session.

    The agent is ``agent`` if given, else the agent's ``name`` (else ``"agent"``). ``predicted_s``
    / ``kind`` describe the tools (one value, or per tool name); the other keywords configure the
    sessions (see :class:`tc.Session`), and ``namespace`` prefixes their ids (default: random per
    capability). The metadata goes in ``extra_body``, which OpenAI-compatible models send; keys
    the caller already set there are kept.
    """

    def __init__(
        self,
        agent: str | None = None,
        *,
        predicted_s: PredictedS = None,
        kind: Kind = "tool",
        namespace: str | None = None,
        importance: float = 1.0,
        next_stall: NextStall | str | None = None,
        events_url: str | bool | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        hooks: tc.StallHook | Sequence[tc.StallHook] | None = None,
        max_sessions: int = 4096,
    ) -> None:
        self.agent = agent
        self.predicted_s = predicted_s
        self.kind = kind
        self.sessions = Sessions(
            namespace=namespace,
            importance=importance,
            next_stall=next_stall,
            events_url=events_url,
            base_url=base_url,
            api_key=api_key,
            hooks=hooks,
            max_sessions=max_sessions,
        )

    def session(self, ctx: RunContext[Any]) -> tc.Session:
        """The session of the run's (conversation, agent)."""
        agent = self.agent or getattr(ctx.agent, "name", None) or "agent"
        return self.sessions.get(ctx.conversation_id, agent)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        return TokenCakeToolset(toolset, session=self.session, predicted_s=self.predicted_s, kind=self.kind)

    async def before_model_request(
        self, ctx: RunContext[Any], request_context: ModelRequestContext
    ) -> ModelRequestContext:
        settings: dict[str, Any] = dict(request_context.model_settings or {})
        settings["extra_body"] = with_metadata(settings.get("extra_body"), self.session(ctx))
        request_context.model_settings = settings  # type: ignore[assignment]  # a ModelSettings dict
        return request_context

    def __repr__(self) -> str:
        return f"TokenCake(agent={self.agent!r}, {self.sessions!r})"


@dataclasses.dataclass
class TokenCakeToolset(WrapperToolset[Any]):
    """A toolset whose every tool call is bracketed by ``stall_begin`` / ``stall_end``.

    ``session`` maps the call's run context to its session. The end is sent also when the tool
    raises (including ``ModelRetry``) or the run is cancelled. Usable on its own:
    ``Agent(model, toolsets=[TokenCakeToolset(FunctionToolset([...]), session=lambda ctx: s)])``.
    """

    session: Callable[[RunContext[Any]], tc.Session] = dataclasses.field(kw_only=True)
    predicted_s: PredictedS = dataclasses.field(default=None, kw_only=True)
    kind: Kind = dataclasses.field(default="tool", kw_only=True)

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        async with tool_stall(self.session(ctx), name, predicted_s=self.predicted_s, kind=self.kind):
            return await super().call_tool(name, tool_args, ctx, tool)
