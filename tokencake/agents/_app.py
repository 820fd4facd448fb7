"""``App``: the declaration of a multi-agent app as a DAG of agents, functions and tools.

Declaring is separate from running: an ``App`` holds node and tool definitions
(:mod:`._app_declare`), builds the ``networkx`` graph and its metadata once (:mod:`._app_graph`),
and ``run`` executes it (see ``_runner``).
"""

from __future__ import annotations

import asyncio
import difflib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import anyio

from ._app_graph import AppGraph
from ._errors import AppDefinitionError
from ._node import Node
from ._tool import Tool

if TYPE_CHECKING:
    from ._llm import LLM
    from ._observe import Observer
    from ._result import RunEvent, RunResult
    from ._run_stream import RunStream
    from ._stall import StallHook

#: The keyword options of ``run`` / ``run_sync`` / ``stream`` (any other keyword must be a declared input).
RUN_OPTIONS = ("llm", "stall", "timeout", "max_concurrency", "run_id", "observer")


class App(AppGraph):
    """A multi-agent app: a DAG of agents and functions that call tools.

    ``inputs`` names the run inputs ``run`` requires; they may be passed as keywords
    (``run(task=...)``). More inputs may be given in the mapping (``run({"task": ..., "extra": ...})``).
    """

    def __init__(self, name: str, *, inputs: Sequence[str] = (), description: str = "") -> None:
        if not name or not isinstance(name, str):
            raise AppDefinitionError("an app needs a non-empty name")
        if isinstance(inputs, str):
            inputs = [inputs]
        self.name = name
        self.inputs: list[str] = list(inputs)
        self.description = description
        self.nodes: dict[str, Node] = {}
        #: Template nodes (``template=True``): run N times at run time by ``ctx.fan_out``.
        self.templates: dict[str, Node] = {}
        self.tools: dict[str, Tool] = {}
        self._node_fns: dict[int, str] = {}
        self._tool_fns: dict[int, str] = {}
        self._analysis_cache = None

    # ------------------------------------------------------------------ running

    async def run(
        self,
        inputs: Mapping[str, Any] | None = None,
        /,
        *,
        llm: LLM | None = None,
        stall: StallHook | Sequence[StallHook] | Literal[False] | None = None,
        timeout: float | None = None,
        max_concurrency: int | None = None,
        run_id: str | None = None,
        observer: Observer | Sequence[Observer] | None = None,
        **kwargs: Any,
    ) -> RunResult:
        """Run the app once and return its :class:`RunResult`.

        Run inputs come as a mapping (``app.run({"task": ...})``) and/or as keywords named in
        ``App(inputs=[...])`` (``app.run(task=...)``); any other keyword is a ``TypeError`` that
        names it and the closest option or input, so a typo (``lllm=``) never becomes an input.

        ``llm`` defaults to ``LLM()`` (environment). ``stall`` adds hooks for stall events; the LLM's
        own reporter (when it has an ``events_url``) is always included unless ``stall=False``.
        ``observer`` is a callable or a list of them, sync or async (async ones are awaited).
        Raises :class:`NodeFailed`, :class:`RunTimeout` (both carry the partial result) or
        :class:`MissingInput`.
        """
        from ._runner import prepare

        state = prepare(
            self,
            llm=llm,
            stall=stall,
            timeout=timeout,
            max_concurrency=max_concurrency,
            run_id=run_id,
            observer=observer,
            inputs=self._run_inputs("run", inputs, kwargs),
        )
        return await state.execute()

    def run_sync(self, inputs: Mapping[str, Any] | None = None, /, **kwargs: Any) -> RunResult:
        """``run`` for scripts. Inside a running event loop (a notebook) it raises ``RuntimeError``."""
        options = {k: kwargs.pop(k) for k in RUN_OPTIONS if k in kwargs}
        merged = self._run_inputs("run_sync", inputs, kwargs)
        if _in_event_loop():
            raise RuntimeError(
                f"App.run_sync() cannot be called from a running event loop (e.g. Jupyter or async code); "
                f"use `await app.run(...)` instead (app {self.name!r})"
            )
        return anyio.run(functools.partial(self.run, merged, **options))

    def stream(
        self,
        inputs: Mapping[str, Any] | None = None,
        /,
        *,
        llm: LLM | None = None,
        stall: StallHook | Sequence[StallHook] | Literal[False] | None = None,
        timeout: float | None = None,
        max_concurrency: int | None = None,
        run_id: str | None = None,
        observer: Observer | Sequence[Observer] | None = None,
        **kwargs: Any,
    ) -> RunStream:
        """Start a run whose events you read as they happen (same arguments as :meth:`run`).

        ``async with app.stream(task=...) as run: async for event in run: ...`` yields every
        :class:`RunEvent` plus the wire-level ``stall_begin`` / ``stall_end`` and, last,
        ``run_result`` (``data["result"]``); ``run.result`` holds the (possibly partial) result.
        Leaving the block early, or ``run.cancel()``, cancels the run.
        """
        from ._run_stream import RunStream
        from ._runner import prepare

        def build(listener: Callable[[RunEvent], None]) -> Any:
            return prepare(
                self,
                llm=llm,
                stall=stall,
                timeout=timeout,
                max_concurrency=max_concurrency,
                run_id=run_id,
                observer=observer,
                inputs=merged,
                listener=listener,
            )

        merged = self._run_inputs("stream", inputs, kwargs)
        return RunStream(build)

    def _run_inputs(
        self, method: str, inputs: Mapping[str, Any] | None, kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The run inputs from the positional mapping and the declared-input keywords."""
        if inputs is not None and not isinstance(inputs, Mapping):
            raise TypeError(
                f"App.{method}() takes the run inputs as a mapping, got {type(inputs).__name__}; "
                f"e.g. app.{method}({{'task': ...}})"
            )
        merged = dict(inputs or {})
        for key, value in kwargs.items():
            if key not in self.inputs:
                raise TypeError(self._unexpected_keyword(method, key))
            if key in merged:
                raise TypeError(
                    f"App.{method}() got run input {key!r} twice (in the mapping and as a keyword)"
                )
            merged[key] = value
        return merged

    def _unexpected_keyword(self, method: str, key: str) -> str:
        known = [*RUN_OPTIONS, *self.inputs]
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}=?" if close else ""
        declared = ", ".join(self.inputs) or "none"
        return (
            f"App.{method}() got an unexpected keyword argument {key!r}{hint} "
            f"(options: {', '.join(RUN_OPTIONS)}; declared inputs of app {self.name!r}: {declared}; "
            f"pass any other run input in the mapping: app.{method}({{{key!r}: ...}}))"
        )

    def __repr__(self) -> str:
        return f"App({self.name!r}, nodes={len(self.nodes)}, tools={len(self.tools)})"


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        pass
    try:
        import sniffio

        sniffio.current_async_library()
        return True
    except Exception:
        return False
