"""Exceptions of the agent SDK.

Every error names what it is about (node, tool, input) so a failing app points at its cause.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import openai

if TYPE_CHECKING:
    from ._result import RunResult


class AppDefinitionError(ValueError):
    """The app's declaration is invalid (cycle, unknown dependency, duplicate name, bad tool, ...).

    ``problems`` lists every problem found, one line each; the message joins them.
    """

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems) if len(self.problems) == 1 else self._joined())

    def _joined(self) -> str:
        return f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)


class MissingInput(KeyError):
    """A required run input (declared in ``App(inputs=[...])``) was not given to ``run``."""

    def __init__(self, app: str, missing: list[str]) -> None:
        self.app = app
        self.missing = missing
        super().__init__(f"app {app!r} needs input(s) {', '.join(map(repr, missing))}")

    def __str__(self) -> str:  # KeyError would print the repr of the message otherwise
        return str(self.args[0])


class NodeFailed(RuntimeError):
    """A node raised; the run was stopped and its siblings cancelled.

    ``__cause__`` is the original exception; ``result`` is the partial :class:`RunResult`.
    """

    def __init__(self, node: str, original: BaseException, result: RunResult | None = None) -> None:
        self.node = node
        self.original = original
        self.result = result
        super().__init__(f"node {node!r} failed: {type(original).__name__}: {original}")


class StrayCancellation(RuntimeError):
    """A node or tool raised a cancellation no cancel scope asked for (``NodeFailed``'s cause).

    For example it awaited a future that another task cancelled. It is that code's failure: as a
    cancellation it would silently stop the run's other nodes and the run would report "ok".
    """


class RunTimeout(TimeoutError):
    """``run(timeout=...)`` expired; all running nodes were cancelled."""

    def __init__(self, timeout: float, pending: list[str], result: RunResult | None = None) -> None:
        self.timeout = timeout
        self.pending = pending
        self.result = result
        what = f" (unfinished: {', '.join(pending)})" if pending else ""
        super().__init__(f"run timed out after {timeout:g} s{what}")


class ToolError(RuntimeError):
    """A tool could not do its job.

    Raise it from a tool to report a failure the model may recover from: in the model-driven
    tool loop a ``ToolError`` goes back to the model as the tool's reply instead of failing the node.
    """

    def __init__(self, message: str, *, tool: str | None = None) -> None:
        self.tool = tool
        super().__init__(message)


class ToolArgumentsError(ToolError, ValueError):
    """Arguments for a tool failed validation against its schema (checked before the call)."""

    def __init__(self, tool: str, detail: str, arguments: Any = None) -> None:
        self.detail = detail
        self.arguments = arguments
        super().__init__(f"invalid arguments for tool {tool!r}: {detail}", tool=tool)


class ToolTimeout(ToolError, TimeoutError):
    """One attempt of a tool ran longer than its ``timeout`` (after all retries, this is raised)."""

    def __init__(self, tool: str, timeout: float, attempts: int = 1) -> None:
        self.timeout = timeout
        self.attempts = attempts
        tries = f" ({attempts} attempts)" if attempts > 1 else ""
        super().__init__(f"tool {tool!r} timed out after {timeout:g} s{tries}", tool=tool)


class LLMConnectionError(openai.APIConnectionError):
    """The LLM server could not be reached (refused, unresolvable, timed out).

    An ``openai.APIConnectionError`` whose message names the URL it tried, because the default
    (``http://127.0.0.1:8000/v1``) is rarely what a failing app meant to talk to.
    """

    def __init__(self, url: str, original: openai.APIConnectionError) -> None:
        self.url = url
        self.timed_out = isinstance(original, openai.APITimeoutError)
        what = "timed out" if self.timed_out else "is unreachable"
        message = (
            f"the LLM server at {url} {what} ({type(original).__name__}: {original}); is it running? "
            "Pass tc.LLM(base_url=...) or set TOKENCAKE_BASE_URL"
        )
        super().__init__(message=message, request=original.request)


class OutputValidationError(ValueError):
    """``ctx.llm(..., output_type=Model)``: the model's replies did not validate, after every retry.

    ``text`` is the last reply, ``detail`` what was wrong with it, ``attempts`` how many replies were
    tried.
    """

    def __init__(self, node: str, output_type: type, text: str, detail: str, attempts: int) -> None:
        self.node = node
        self.output_type = output_type
        self.text = text
        self.detail = detail
        self.attempts = attempts
        super().__init__(f"node {node!r}: no valid {output_type.__name__} after {attempts} replies: {detail}")
