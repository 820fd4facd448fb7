"""The TokenCake agent SDK: declare multi-agent apps as DAGs and run them on anyio.

Everything public is re-exported here (and from ``tokencake``); the ``_x`` modules are private.
"""

from ._app import App, Node
from ._context import Context
from ._errors import (
    AppDefinitionError,
    MissingInput,
    NodeFailed,
    RunTimeout,
    ToolArgumentsError,
    ToolError,
    ToolTimeout,
)
from ._llm import LLM, LLMReply, ToolCall, Usage
from ._result import NodeResult, RunEvent, RunResult
from ._scripted import ScriptedLLM, ScriptedRequest
from ._stall import HttpStallReporter, StallHook, StallRecorder
from ._tool import Tool

__all__ = [
    "LLM",
    "App",
    "AppDefinitionError",
    "Context",
    "HttpStallReporter",
    "LLMReply",
    "MissingInput",
    "Node",
    "NodeFailed",
    "NodeResult",
    "RunEvent",
    "RunResult",
    "RunTimeout",
    "ScriptedLLM",
    "ScriptedRequest",
    "StallHook",
    "StallRecorder",
    "Tool",
    "ToolArgumentsError",
    "ToolCall",
    "ToolError",
    "ToolTimeout",
    "Usage",
]

# Show the public names as living here (nicer reprs and tracebacks), like anyio and httpx do.
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("tokencake.agents._"):
        _obj.__module__ = __name__
del _name, _obj
