"""The TokenCake agent SDK: declare multi-agent apps as DAGs and run them on anyio.

Everything public is re-exported here (and from ``tokencake``); the ``_x`` modules are private.
``Session``, ``stall``, ``request_metadata``, ``TokenCakeTransport`` and ``openai_client`` bring
the server-side benefit to agents written with any other OpenAI-compatible client or framework.
"""

from ._app import App
from ._context import Context
from ._errors import (
    AppDefinitionError,
    LLMConnectionError,
    MissingInput,
    NodeFailed,
    OutputValidationError,
    RunTimeout,
    ToolArgumentsError,
    ToolError,
    ToolTimeout,
)
from ._llm import LLM, LLMReply, ToolCall, Usage
from ._llm_stream import LLMStream
from ._metadata import request_metadata
from ._node import Node
from ._otel import OTelObserver
from ._result import NodeResult, RunEvent, RunResult
from ._retry import Retry
from ._run_stream import RunStream
from ._scripted import ScriptedLLM, ScriptedRequest
from ._session import Session, stall
from ._stall import HttpStallReporter, StallHook, StallRecorder, StallScope
from ._tool import Tool
from ._transport import TokenCakeTransport, openai_client

__all__ = [
    "LLM",
    "App",
    "AppDefinitionError",
    "Context",
    "HttpStallReporter",
    "LLMConnectionError",
    "LLMReply",
    "LLMStream",
    "MissingInput",
    "Node",
    "NodeFailed",
    "NodeResult",
    "OTelObserver",
    "OutputValidationError",
    "Retry",
    "RunEvent",
    "RunResult",
    "RunStream",
    "RunTimeout",
    "ScriptedLLM",
    "ScriptedRequest",
    "Session",
    "StallHook",
    "StallRecorder",
    "StallScope",
    "TokenCakeTransport",
    "Tool",
    "ToolArgumentsError",
    "ToolCall",
    "ToolError",
    "ToolTimeout",
    "Usage",
    "openai_client",
    "request_metadata",
    "stall",
]

# Show the public names as living here (nicer reprs and tracebacks), like anyio and httpx do.
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("tokencake.agents._"):
        _obj.__module__ = __name__
del _name, _obj
