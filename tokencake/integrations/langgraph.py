"""TokenCake for LangGraph and LangChain agents (``pip install 'tokencake[langgraph]'``).

:class:`TokenCakeMiddleware` is agent middleware for ``langchain.agents.create_agent``: it adds the
conversation's TokenCake fields to every model call (``extra_body``) and brackets every tool call
with ``tc.stall``. Sessions are keyed by thread and agent, not by graph node, so a ReAct agent's
model node and tool node are one session, and two agents of one thread are two. Hand-built graphs
use the same object: ``ToolNode(tools, awrap_tool_call=tk.awrap_tool_call)`` for the stalls and a
chat model whose ``http_async_client`` wraps :meth:`TokenCakeMiddleware.transport` for the
requests. LangChain callbacks are not used for the stalls: none of them runs when a tool is
cancelled. What the server did with the KV during a tool call is dispatched as a
``tokencake_kv`` custom callback event when the model's requests go through the transport.
"""

from __future__ import annotations

import contextvars
import logging
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.callbacks.manager import adispatch_custom_event, dispatch_custom_event
from langchain_core.messages import ToolMessage
from langgraph.config import get_config
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

import tokencake as tc
from tokencake.events import NextStall

from ._kv import KvTransport, Resumes, ToolCallRef
from ._metadata import with_metadata
from ._sessions import Sessions
from ._stalls import Kind, PredictedS, StampCheck, blocking, tool_stall

__all__ = ["KV_EVENT", "TokenCakeMiddleware"]

log = logging.getLogger("tokencake.integrations")

#: The name of the custom callback event carrying a tool call's KV report.
KV_EVENT = "tokencake_kv"

ToolResult = ToolMessage | Command[Any]

#: Set while a model call runs whose request the middleware stamped itself (``extra_body``): the
#: transport then leaves it alone (stamping twice would count the turn twice).
_STAMPED: contextvars.ContextVar[bool] = contextvars.ContextVar("tokencake_langgraph_stamped", default=False)

_FIX = (
    "Add TokenCakeMiddleware to create_agent(middleware=[...]), or build the model with "
    "http_async_client=httpx.AsyncClient(transport=tk.transport())."
)


class TokenCakeMiddleware(AgentMiddleware[Any, Any, Any]):
    """Agent middleware that gives each (thread, agent) conversation a TokenCake session.

    The thread is the run's ``configurable.thread_id``: pass one per conversation, as a
    checkpointer needs anyway (without one, all runs of an agent share one session, with a
    ``RuntimeWarning``). The agent is ``agent`` if given, else the name passed to ``create_agent``
    (``lc_agent_name``), else the enclosing subgraph, else ``"agent"``. ``predicted_s`` / ``kind``
    describe the tools (one value, or per tool name); the other keywords configure the sessions
    (see :class:`tc.Session`), and ``namespace`` prefixes their ids (default: random per
    middleware). Without ``base_url`` a session's server is the model's ``base_url``
    (``tc.Session.use_server``).
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
        super().__init__()
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
        self._warned_model: set[str] = set()
        self._warned_thread = False
        self._check = StampCheck(_FIX)
        self._resumes = Resumes(max_sessions)

    def session(self, runtime: Any = None) -> tc.Session:
        """The session of the running (thread, agent): from ``runtime``, else the runnable config."""
        config: dict[str, Any] = getattr(runtime, "config", None) or _current_config()
        configurable = config.get("configurable") or {}
        metadata = config.get("metadata") or {}
        info = getattr(runtime, "execution_info", None)
        thread = (
            getattr(info, "thread_id", None) or configurable.get("thread_id") or metadata.get("thread_id")
        )
        namespace = (
            getattr(info, "checkpoint_ns", None)
            or configurable.get("checkpoint_ns")
            or metadata.get("langgraph_checkpoint_ns")
            or ""
        )
        agent = self.agent or metadata.get("lc_agent_name") or _enclosing_graph(namespace) or "agent"
        if thread is None and config and not self._warned_thread:
            self._warned_thread = True
            warnings.warn(
                "TokenCakeMiddleware: a run without configurable.thread_id; all such runs of an agent "
                "share one TokenCake session, so concurrent ones interleave their turns. Pass "
                "{'configurable': {'thread_id': ...}} per conversation.",
                RuntimeWarning,
                stacklevel=2,
            )
        return self.sessions.get(None if thread is None else str(thread), str(agent))

    def transport(
        self, transport: httpx.AsyncBaseTransport | httpx.BaseTransport | None = None
    ) -> httpx.AsyncBaseTransport:
        """An httpx transport stamping each chat completion with the running conversation's session,
        and dispatching the server's KV report of each tool call its responses resume.

        For graphs built by hand: ``ChatOpenAI(..., http_async_client=httpx.AsyncClient(
        transport=tk.transport()))`` (and ``http_client=httpx.Client(...)`` for sync runs). With
        ``create_agent`` it adds the KV reports only: the middleware stamps those requests itself.
        The returned object is also an ``httpx.BaseTransport``.
        """

        def unstamped() -> tc.Session | None:
            return None if _STAMPED.get() else self.session()

        stamping = tc.TokenCakeTransport(unstamped, transport)
        return KvTransport(stamping, self.session, self._resumes, _emit, _aemit)

    # ------------------------------------------------------------------ model calls

    def wrap_model_call(
        self, request: ModelRequest[Any], handler: Callable[[ModelRequest[Any]], ModelResponse[Any]]
    ) -> Any:
        stamped = self._stamped(request)
        token = _STAMPED.set(stamped is not request)
        try:
            return handler(stamped)
        finally:
            _STAMPED.reset(token)

    async def awrap_model_call(
        self,
        request: ModelRequest[Any],
        handler: Callable[[ModelRequest[Any]], Awaitable[ModelResponse[Any]]],
    ) -> Any:
        stamped = self._stamped(request)
        token = _STAMPED.set(stamped is not request)
        try:
            return await handler(stamped)
        finally:
            _STAMPED.reset(token)

    def _stamped(self, request: ModelRequest[Any]) -> ModelRequest[Any]:
        settings = request.model_settings
        if "extra_body" in settings:
            extra_body = settings["extra_body"]
        elif hasattr(request.model, "extra_body"):  # ChatOpenAI and its relatives
            extra_body = request.model.extra_body
        else:
            model = type(request.model).__name__
            if model not in self._warned_model:
                self._warned_model.add(model)
                self._check.warned = True  # this is the warning the stalls would give
                warnings.warn(
                    f"{model} has no extra_body: its requests cannot carry TokenCake's session "
                    "metadata (use ChatOpenAI against a TokenCake server)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return request
        session = self.session(request.runtime)
        base_url = getattr(request.model, "openai_api_base", None)
        if base_url:
            session.use_server(str(base_url))
        return request.override(model_settings={**settings, "extra_body": with_metadata(extra_body, session)})

    # ------------------------------------------------------------------ tool calls

    def wrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], ToolResult]
    ) -> ToolResult:
        scope = self._stall(request)
        try:
            with blocking(scope):
                return _checked(scope, handler(request))
        finally:
            self._ended(request, scope)

    async def awrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], Awaitable[ToolResult]]
    ) -> ToolResult:
        scope = self._stall(request)
        try:
            async with scope:
                return _checked(scope, await handler(request))
        finally:
            self._ended(request, scope)

    def _stall(self, request: ToolCallRequest) -> tc.StallScope:
        session = self.session(request.runtime)
        self._check.check(session)
        name = str(request.tool_call.get("name") or "tool")
        attempt = getattr(getattr(request.runtime, "execution_info", None), "node_attempt", 1) or 1
        return tool_stall(session, name, predicted_s=self.predicted_s, kind=self.kind, attempt=int(attempt))

    def _ended(self, request: ToolCallRequest, scope: tc.StallScope) -> None:
        if scope.outcome != "cancelled":  # the run goes on: the next turn resumes it
            call_id = request.tool_call.get("id")
            begin = scope.begin
            self._resumes.ended(ToolCallRef(begin.session_id, begin.tool, begin.stall_id, call_id))

    def __repr__(self) -> str:
        return f"TokenCakeMiddleware(agent={self.agent!r}, {self.sessions!r})"


def _emit(call: ToolCallRef, report: dict[str, Any]) -> None:
    try:
        dispatch_custom_event(KV_EVENT, report)
    except Exception as exc:  # no run to attach it to (a model called outside a graph)
        log.debug("tokencake_kv event not dispatched: %s", exc)


async def _aemit(call: ToolCallRef, report: dict[str, Any]) -> None:
    try:
        await adispatch_custom_event(KV_EVENT, report)
    except Exception as exc:
        log.debug("tokencake_kv event not dispatched: %s", exc)


def _checked(scope: tc.StallScope, result: ToolResult) -> ToolResult:
    """Report a tool error that ``ToolNode`` turned into an error message as the stall's outcome."""
    if isinstance(result, ToolMessage) and result.status == "error":
        scope.fail("error", str(result.content)[:2000])
    return result


def _current_config() -> dict[str, Any]:
    try:
        return dict(get_config())
    except RuntimeError:  # not inside a runnable (e.g. a model called directly)
        return {}


def _enclosing_graph(checkpoint_ns: str) -> str:
    """``"researcher"`` for a node of subgraph ``researcher`` (``researcher:<id>|tools:<id>``)."""
    parents = checkpoint_ns.split("|")[:-1]
    return "/".join(part.split(":", 1)[0] for part in parents if part)
