"""A tool: a Python function the agents call, with its schema and its timing hints.

The timing hints (``predict_time``, ``stages``) are what makes TokenCake useful: they travel with
every stall event so the server can decide whether the agent's KV cache is worth moving out.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from pydantic import BaseModel

from ._errors import AppDefinitionError, ToolArgumentsError
from ._loop import stray_cancellation_fails
from ._retry import TOOL_ERRORS, ExceptionTypes, Retry, as_retry
from ._schema import SchemaError, build_args_model, json_schema, validate_args

# OpenAI function names: letters, digits, underscores and dashes, at most 64 characters.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: The wire format accepts predictions up to a day.
_MAX_PREDICT_S = 86400.0


@dataclass(eq=False)
class Tool:
    """A registered tool. Build it with ``@app.tool(...)`` or ``app.add_tool(fn, ...)``.

    ``retries`` is a number of extra attempts or a :class:`Retry`; ``retry_on`` narrows which
    exceptions are retried (default: any). ``retry`` is the resulting policy.
    """

    name: str
    fn: Callable[..., Any]
    predict_time: float | None = None
    kind: str = "tool"
    stages: dict[str, float] | None = None
    timeout: float | None = None
    retries: int | Retry = 0
    description: str = ""
    retry_on: type[BaseException] | ExceptionTypes | None = None
    retry: Retry = field(init=False, repr=False)
    args_model: type[BaseModel] = field(init=False, repr=False)
    _positional: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        problems = []
        if not _TOOL_NAME.match(self.name):
            problems.append(f"tool name {self.name!r} must match [A-Za-z0-9_-]{{1,64}} (an OpenAI name)")
        pt = self.predict_time
        if pt is not None and not (isinstance(pt, int | float) and 0 <= pt <= _MAX_PREDICT_S):
            problems.append(f"tool {self.name!r}: predict_time must be a number in [0, {_MAX_PREDICT_S:g}] s")
        if not isinstance(self.kind, str) or not 0 < len(self.kind) <= 100:
            problems.append(f"tool {self.name!r}: kind must be a string of 1..100 characters")
        if self.timeout is not None and not (self.timeout > 0):
            problems.append(f"tool {self.name!r}: timeout must be > 0 seconds")
        try:
            self.retry = as_retry(self.retries, retry_on=self.retry_on, what="retries") or Retry(0)
        except (TypeError, ValueError) as exc:
            problems.append(f"tool {self.name!r}: retries must be an int >= 0 or a tc.Retry ({exc})")
        if self.stages is not None:
            if not isinstance(self.stages, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int | float) and 0 <= v <= _MAX_PREDICT_S
                for k, v in self.stages.items()
            ):
                problems.append(f"tool {self.name!r}: stages must map names to seconds >= 0")
            elif self.predict_time is None and sum(self.stages.values()) > _MAX_PREDICT_S:
                problems.append(f"tool {self.name!r}: stages must add up to at most {_MAX_PREDICT_S:g} s")
            else:
                self.stages = {k: float(v) for k, v in self.stages.items()}
        if not callable(self.fn):
            problems.append(f"tool {self.name!r}: {self.fn!r} is not callable")
        if problems:
            raise AppDefinitionError(problems)
        try:
            model, doc, positional = build_args_model(self.fn, self.name)
        except SchemaError as exc:
            raise AppDefinitionError(f"tool {self.name!r}: {exc}") from exc
        self.args_model = model
        self._positional = positional
        if not self.description:
            self.description = doc or self.name

    @property
    def is_async(self) -> bool:
        return is_async_callable(self.fn)

    def should_retry(self, exc: BaseException, attempt: int) -> bool:
        """True when attempt ``attempt`` ended with ``exc`` and the policy allows another one."""
        return self.retry.should_retry(exc, attempt, TOOL_ERRORS)

    @property
    def predicted_s(self) -> float | None:
        """The duration hint: ``predict_time``, else the sum of ``stages``, else None."""
        if self.predict_time is not None:
            return float(self.predict_time)
        if self.stages:
            return float(sum(self.stages.values()))
        return None

    @property
    def parameters(self) -> dict[str, Any]:
        """JSON schema of the arguments."""
        return json_schema(self.args_model)

    def openai_schema(self) -> dict[str, Any]:
        """The entry for the OpenAI ``tools=`` parameter."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validate(self, arguments: Mapping[str, Any] | Any) -> dict[str, Any]:
        """Validated keyword arguments, or :class:`ToolArgumentsError` naming the tool."""
        try:
            args = dict(arguments) if isinstance(arguments, Mapping) else arguments
            return validate_args(self.args_model, args)
        except ValueError as exc:
            raise ToolArgumentsError(self.name, str(exc), arguments) from None

    async def invoke(self, arguments: dict[str, Any]) -> Any:
        """Run one attempt with already validated arguments (sync functions in a worker thread).

        A sync tool cannot be interrupted; on timeout or cancellation its thread is abandoned and
        finishes in the background.
        """
        args = [arguments[p] for p in self._positional]
        kwargs = {k: v for k, v in arguments.items() if k not in self._positional}
        if self.is_async:
            with stray_cancellation_fails(f"tool {self.name!r}"):
                return await self.fn(*args, **kwargs)
        result = await anyio.to_thread.run_sync(
            functools.partial(self.fn, *args, **kwargs), abandon_on_cancel=True
        )
        if inspect.isawaitable(result):  # a sync wrapper that returned a coroutine
            return await result
        return result


def is_async_callable(fn: Any) -> bool:
    """True for ``async def`` functions, partials of them and objects with an async ``__call__``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    return callable(fn) and inspect.iscoroutinefunction(fn.__call__)
