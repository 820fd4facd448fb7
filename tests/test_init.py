"""The package's public names: ``tokencake.__all__`` and ``tokencake.agents.__all__`` are the API."""

from __future__ import annotations

import tokencake
import tokencake.agents

PUBLIC = [
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
    "__version__",
    "events",
    "openai_client",
    "request_metadata",
    "stall",
    "testing",
]


def test_tokencake_all_is_pinned() -> None:
    assert tokencake.__all__ == PUBLIC
    assert all(hasattr(tokencake, name) for name in PUBLIC)


def test_the_sdk_exports_the_same_objects_as_tokencake() -> None:
    sdk = [name for name in PUBLIC if name not in ("__version__", "events", "testing")]
    assert tokencake.agents.__all__ == sdk
    assert all(getattr(tokencake.agents, name) is getattr(tokencake, name) for name in sdk)


def test_public_classes_and_functions_show_the_sdk_as_their_module() -> None:
    defined = [getattr(tokencake.agents, name) for name in tokencake.agents.__all__]
    shown = {obj.__module__ for obj in defined if isinstance(obj, type) or callable(obj)}
    assert shown == {"tokencake.agents"}
