"""``Node``: one declared agent or function of an app, and ``Ref``: how declarations name things."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ._tool import Tool, is_async_callable

Ref = str | Callable[..., Any] | Tool


@dataclass(eq=False)
class Node:
    """A DAG node: an ``agent`` (makes LLM calls) or a local ``function``.

    A ``template`` node is not part of the DAG: nodes run instances of it with ``ctx.fan_out``.
    """

    name: str
    fn: Callable[..., Any]
    kind: Literal["agent", "function"]
    after: list[Ref] = field(default_factory=list)
    calls: list[Ref] = field(default_factory=list)
    tools: list[Ref] = field(default_factory=list)
    system: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    #: Request fields every ``ctx.llm`` call of the node sends (sampling options such as
    #: ``repetition_penalty``); a call's own ``extra_body`` keys win.
    extra_body: Mapping[str, Any] | None = None
    importance: float = 1.0
    agent_type: str | None = None
    predict_llm_s: float | None = None
    predict_s: float | None = None
    description: str = ""
    template: bool = False

    @property
    def is_async(self) -> bool:
        return is_async_callable(self.fn)

    def options(self) -> dict[str, Any]:
        """The declared options (dependency/tool references as names where resolvable)."""
        return {
            "system": self.system,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "extra_body": dict(self.extra_body) if self.extra_body else None,
            "importance": self.importance,
            "agent_type": self.agent_type or self.name,
            "predict_llm_s": self.predict_llm_s,
            "predict_s": self.predict_s,
            "description": self.description,
        }


def fn_name(fn: Any) -> str:
    """The name a function (or a partial of one) declares a node or tool under."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__
