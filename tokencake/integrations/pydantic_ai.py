"""TokenCake for Pydantic AI (``pip install 'tokencake[pydantic-ai]'``).

:class:`TokenCake` is a capability: ``Agent(model, tools=[...], capabilities=[TokenCake()])``. It
adds the conversation's TokenCake fields to every model request (``extra_body``, so it works with
any OpenAI-compatible model the agent already has) and wraps the agent's toolset in
:class:`TokenCakeToolset`, which runs every tool call inside ``tc.stall``. Sessions are keyed by
Pydantic AI's ``conversation_id`` (stable across runs that continue a ``message_history``) and the
agent's name. What the server did with the KV during each tool call becomes a ``tokencake.kv``
span under the tool call's span, on the run's tracer (Pydantic AI's instrumentation, Logfire).
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from pydantic_ai import RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelResponse
from pydantic_ai.models import ModelRequestContext
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset

import tokencake as tc
from tokencake.events import NextStall

from ._kv import Resumes, ToolCallRef, otel_attributes, provenance
from ._metadata import with_metadata
from ._sessions import Sessions
from ._stalls import Kind, PredictedS, StampCheck, tool_stall

__all__ = ["TokenCake", "TokenCakeToolset"]

#: The OpenAI model setting that keeps a response's vendor fields (``kv_transfer_params``).
_UNMAPPED = "openai_include_unmapped_response_data"
#: Whether the capability turned ``_UNMAPPED`` on for the running request (then it drops them again).
_TURNED_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("tokencake_unmapped", default=False)

_FIX = (
    "Add the TokenCake capability (Agent(..., capabilities=[TokenCake()])), which stamps the requests, "
    "or give the model's client tc.TokenCakeTransport(session)."
)


class TokenCake(AbstractCapability[Any]):
    """Capability that gives each (conversation, agent) of a Pydantic AI agent a TokenCake session.

    The agent is ``agent`` if given, else the agent's ``name`` (else ``"agent"``). ``predicted_s``
    / ``kind`` describe the tools (one value, or per tool name); the other keywords configure the
    sessions (see :class:`tc.Session`), and ``namespace`` prefixes their ids (default: random per
    capability). Without ``base_url`` a session's server is the model's ``base_url``
    (``tc.Session.use_server``). The metadata goes in ``extra_body``, which OpenAI-compatible
    models send; keys the caller already set there are kept. To read the server's KV provenance it
    sets ``openai_include_unmapped_response_data`` and drops what it added from the response.
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
        self._resumes = Resumes(max_sessions)

    def session(self, ctx: RunContext[Any]) -> tc.Session:
        """The session of the run's (conversation, agent)."""
        agent = self.agent or getattr(ctx.agent, "name", None) or "agent"
        return self.sessions.get(ctx.conversation_id, agent)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        return TokenCakeToolset(
            toolset,
            session=self.session,
            predicted_s=self.predicted_s,
            kind=self.kind,
            _resumes=self._resumes,
        )

    async def before_model_request(
        self, ctx: RunContext[Any], request_context: ModelRequestContext
    ) -> ModelRequestContext:
        session = self.session(ctx)
        base_url = getattr(request_context.model, "base_url", None)
        if base_url:
            session.use_server(str(base_url))
        settings: dict[str, Any] = dict(request_context.model_settings or {})
        settings["extra_body"] = with_metadata(settings.get("extra_body"), session)
        _TURNED_ON.set(_UNMAPPED not in settings)
        settings.setdefault(_UNMAPPED, True)
        request_context.model_settings = settings  # type: ignore[assignment]  # a ModelSettings dict
        return request_context

    async def after_model_request(
        self, ctx: RunContext[Any], *, request_context: ModelRequestContext, response: ModelResponse
    ) -> ModelResponse:
        details = response.provider_details or {}
        unmapped = details.get("unmapped") if isinstance(details.get("unmapped"), Mapping) else {}
        extras = unmapped.get("response") if isinstance(unmapped.get("response"), Mapping) else {}
        if _TURNED_ON.get() and "unmapped" in details:  # not asked for: leave the history as it was
            response.provider_details = {k: v for k, v in details.items() if k != "unmapped"} or None
        resumed = self._resumes.resumed(
            self.session(ctx).session_id,
            provenance(extras.get("kv_transfer_params")),
            prompt_tokens=response.usage.input_tokens,
            completion_tokens=response.usage.output_tokens,
        )
        for call, report in resumed:
            parent = trace.set_span_in_context(trace.NonRecordingSpan(call.span)) if call.span else None
            ctx.tracer.start_span("tokencake.kv", context=parent, attributes=otel_attributes(report)).end()
        return response

    def __repr__(self) -> str:
        return f"TokenCake(agent={self.agent!r}, {self.sessions!r})"


@dataclasses.dataclass
class TokenCakeToolset(WrapperToolset[Any]):
    """A toolset whose every tool call is bracketed by ``stall_begin`` / ``stall_end``.

    ``session`` maps the call's run context to its session. The end is sent also when the tool
    raises (including ``ModelRetry``: each retry is its own stall, ``attempt`` counting from 1) or
    the run is cancelled. Usable on its own:
    ``Agent(model, toolsets=[TokenCakeToolset(FunctionToolset([...]), session=lambda ctx: s)])``,
    but then the model's requests must carry the session's metadata too (the ``TokenCake``
    capability, or a client over ``tc.TokenCakeTransport(s)``): a ``RuntimeWarning`` says so at
    the first tool call of a session whose requests carried none.
    """

    session: Callable[[RunContext[Any]], tc.Session] = dataclasses.field(kw_only=True)
    predicted_s: PredictedS = dataclasses.field(default=None, kw_only=True)
    kind: Kind = dataclasses.field(default="tool", kw_only=True)
    #: Where finished tool calls wait for their KV report (set by the TokenCake capability).
    _resumes: Resumes | None = dataclasses.field(default=None, kw_only=True, repr=False)
    _check: StampCheck = dataclasses.field(default_factory=lambda: StampCheck(_FIX), init=False, repr=False)

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        session = self.session(ctx)
        self._check.check(session)
        scope = tool_stall(session, name, predicted_s=self.predicted_s, kind=self.kind, attempt=ctx.retry + 1)
        span = trace.get_current_span().get_span_context()  # the tool call's span, when instrumented
        try:
            async with scope:
                return await super().call_tool(name, tool_args, ctx, tool)
        finally:
            if self._resumes is not None and scope.outcome != "cancelled":
                ref = ToolCallRef(
                    session.session_id,
                    name,
                    scope.stall_id,
                    ctx.tool_call_id,
                    span if span.is_valid else None,
                )
                self._resumes.ended(ref)
