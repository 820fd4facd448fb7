"""The bundled apps: ready-made multi-agent workloads with real offline tools.

``get_app(name, **params)`` builds a fresh :class:`tokencake.App`; ``list_apps()`` describes them;
``scripted_llm(name)`` gives a :class:`tokencake.ScriptedLLM` whose replies make the app succeed
offline (the tests and ``tokencake run APP --scripted`` use it). Every app takes the run input
``task`` (with a sensible default in ``default_inputs(name)``) and these build parameters:

- ``latency``: ``real`` | ``paper`` | ``scaled:X`` — tool durations (see ``_latency``).
- ``seed`` / ``noise``: seeded lognormal noise on the padded tool durations.
- ``workdir``: where per-run sandbox directories go (default: the system temp dir).
- ``token_scale``: multiplies every node's ``max_tokens`` (short budgets for quick CPU runs).
- ``context``: ``realistic`` (default) | ``small`` — how much tool output (documents, files, test
  logs) the agents carry in their conversations; ``realistic`` is ~2.5-2.9k tokens per agent, sized
  for the bundled model's 4,096-token context (see ``_material`` and docs/apps.md).

plus app-specific ones (``branches`` for deep-research, ``width`` for map-reduce, ``max_turns``
for tool-agent, ``test_timeout`` for code-writer and tool-agent).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import tokencake as tc
from tokencake.agents.catalog import code_writer, deep_research, map_reduce, rag, tool_agent
from tokencake.agents.catalog._env import ENV_DEFAULTS
from tokencake.agents.catalog._latency import LatencyModel


class UnknownApp(LookupError):
    """No bundled app has this name; the message lists the ones that exist."""


@dataclass(frozen=True)
class AppInfo:
    """What ``list_apps`` reports about one app."""

    name: str
    shape: str
    nodes: int
    tools: int
    description: str
    inputs: dict[str, str]  # required run input -> default value
    params: dict[str, Any]  # build parameter -> default value

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": self.shape,
            "nodes": self.nodes,
            "tools": self.tools,
            "description": self.description,
            "inputs": dict(self.inputs),
            "params": dict(self.params),
        }


_MODULES: dict[str, ModuleType] = {
    m.NAME: m for m in (code_writer, deep_research, rag, map_reduce, tool_agent)
}


def _module(name: str) -> ModuleType:
    module = _MODULES.get(name)
    if module is None:
        raise UnknownApp(f"unknown app {name!r}; available apps: {', '.join(app_names())}")
    return module


def app_names() -> list[str]:
    """Names of the bundled apps, in catalog order."""
    return list(_MODULES)


def build_params(name: str) -> dict[str, Any]:
    """Build parameters of app ``name`` and their defaults."""
    sig = inspect.signature(_module(name).build)
    own = {p.name: p.default for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return {**ENV_DEFAULTS, **own}


def get_app(name: str, **params: Any) -> tc.App:
    """A new instance of bundled app ``name`` (see the module docstring for ``params``)."""
    module = _module(name)
    allowed = build_params(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise TypeError(
            f"app {name!r} has no parameter {', '.join(map(repr, unknown))}; parameters: {', '.join(allowed)}"
        )
    if "latency" in params:
        LatencyModel.parse(params["latency"])  # fail early with a clear message
    return module.build(**params)


def default_inputs(name: str) -> dict[str, str]:
    """The run inputs app ``name`` requires, with their default values."""
    return dict(_module(name).DEFAULT_INPUTS)


def scripted_replies(name: str) -> Callable[[tc.ScriptedRequest], Any]:
    """The deterministic reply function that makes app ``name`` succeed on its default task."""
    return _module(name).script


def scripted_llm(name: str, **kwargs: Any) -> tc.ScriptedLLM:
    """A :class:`tokencake.ScriptedLLM` speaking :func:`scripted_replies` (kwargs go to it)."""
    return tc.ScriptedLLM(scripted_replies(name), **kwargs)


def final_answer(name: str, output: Any) -> str:
    """A short human-readable answer from the output of app ``name`` (for terminals)."""
    if not isinstance(output, dict):
        return str(output)
    return str(_module(name).final_answer(output))


def app_info(name: str) -> AppInfo:
    module = _module(name)
    app = module.build()
    return AppInfo(
        name=module.NAME,
        shape=module.SHAPE,
        nodes=len(app.nodes),
        tools=len(app.tools),
        description=module.DESCRIPTION,
        inputs=default_inputs(name),
        params=build_params(name),
    )


def list_apps() -> list[AppInfo]:
    """One :class:`AppInfo` per bundled app (built with default parameters to count nodes)."""
    return [app_info(name) for name in app_names()]


__all__ = [
    "AppInfo",
    "UnknownApp",
    "app_info",
    "app_names",
    "build_params",
    "default_inputs",
    "final_answer",
    "get_app",
    "list_apps",
    "scripted_llm",
    "scripted_replies",
]
