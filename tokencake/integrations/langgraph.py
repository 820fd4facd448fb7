"""TokenCake for LangGraph and LangChain agents (``pip install 'tokencake[langgraph]'``).

:class:`TokenCakeMiddleware` is agent middleware for ``langchain.agents.create_agent``: it adds the
conversation's TokenCake fields to every model call (``extra_body``) and brackets every tool call
with ``tc.stall``. Sessions are keyed by thread and agent, not by graph node, so a ReAct agent's
model node and tool node are one session, and two agents of one thread are two. Hand-built graphs
use the same object: ``ToolNode(tools, awrap_tool_call=tk.awrap_tool_call)`` for the stalls and a
chat model whose ``http_async_client`` wraps :meth:`TokenCakeMiddleware.transport` for the
requests. LangChain callbacks are not used: none of them runs when a tool is cancelled.
"""

from __future__ import annotations

import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.messages import ToolMessage
from langgraph.config import get_config
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

import tokencake as tc
from tokencake.events import NextStall

from ._metadata import with_metadata
from ._sessions import Sessions
from ._stalls import Kind, PredictedS, blocking, tool_stall

__all__ = ["TokenCakeMiddleware"]

ToolResult = ToolMessage | Command[Any]


class TokenCakeMiddleware(AgentMiddleware[Any, Any, Any]):
    """Agent middleware that gives each (thread, agent) conversation a TokenCake session.

    The thread is the run's ``configurable.thread_id`` (pass one per conversation, as a
    checkpointer needs anyway; without one, each agent gets one session). The agent is ``agent``
    if given, else the name passed to ``create_agent`` (``lc_agent_name``), else the enclosing
    subgraph, else ``"agent"``. ``predicted_s`` / ``kind`` describe the tools (one value, or per
    tool name); the other keywords configure the sessions (see :class:`tc.Session`), and
    ``namespace`` prefixes their ids (default: random per middleware).
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
        return self.sessions.get(None if thread is None else str(thread), str(agent))

    def transport(
        self, transport: httpx.AsyncBaseTransport | httpx.BaseTransport | None = None
    ) -> tc.TokenCakeTransport:
        """An httpx transport stamping each chat completion with the running conversation's session.

        For graphs built by hand: ``ChatOpenAI(..., http_async_client=httpx.AsyncClient(
        transport=tk.transport()))`` (and ``http_client=httpx.Client(...)`` for sync runs).
        """
        return tc.TokenCakeTransport(self.session, transport)

    # ------------------------------------------------------------------ model calls

    def wrap_model_call(
        self, request: ModelRequest[Any], handler: Callable[[ModelRequest[Any]], ModelResponse[Any]]
    ) -> Any:
        return handler(self._stamped(request))

    async def awrap_model_call(
        self,
        request: ModelRequest[Any],
        handler: Callable[[ModelRequest[Any]], Awaitable[ModelResponse[Any]]],
    ) -> Any:
        return await handler(self._stamped(request))

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
                warnings.warn(
                    f"{model} has no extra_body: its requests cannot carry TokenCake's session "
                    "metadata (use ChatOpenAI against a TokenCake server)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return request
        session = self.session(request.runtime)
        return request.override(model_settings={**settings, "extra_body": with_metadata(extra_body, session)})

    # ------------------------------------------------------------------ tool calls

    def wrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], ToolResult]
    ) -> ToolResult:
        with blocking(self._stall(request)) as scope:
            return _checked(scope, handler(request))

    async def awrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], Awaitable[ToolResult]]
    ) -> ToolResult:
        async with self._stall(request) as scope:
            return _checked(scope, await handler(request))

    def _stall(self, request: ToolCallRequest) -> tc.StallScope:
        session = self.session(request.runtime)
        name = str(request.tool_call.get("name") or "tool")
        return tool_stall(session, name, predicted_s=self.predicted_s, kind=self.kind)

    def __repr__(self) -> str:
        return f"TokenCakeMiddleware(agent={self.agent!r}, {self.sessions!r})"


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
