"""TokenCake: multi-agent apps as DAGs, with a vLLM extension that parks KV cache during tool calls.

``import tokencake as tc`` gives the SDK (``tc.App``, ``tc.LLM``, ``tc.ScriptedLLM``, ...) and the
wire format module ``tc.events``.
"""

from . import events
from ._version import __version__
from .agents import (
    LLM,
    App,
    AppDefinitionError,
    Context,
    HttpStallReporter,
    LLMReply,
    MissingInput,
    Node,
    NodeFailed,
    NodeResult,
    RunEvent,
    RunResult,
    RunTimeout,
    ScriptedLLM,
    ScriptedRequest,
    StallHook,
    StallRecorder,
    Tool,
    ToolArgumentsError,
    ToolCall,
    ToolError,
    ToolTimeout,
    Usage,
)

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
    "__version__",
    "events",
]
