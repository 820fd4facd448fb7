"""``App``: the declaration of a multi-agent app as a DAG of agents, functions and tools.

Declaring is separate from running: an ``App`` holds node and tool definitions, builds the
``networkx`` graph and its metadata once, and ``run`` executes it (see ``_runner``).
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import anyio
import networkx as nx

from tokencake.events import GraphMeta

from ._errors import AppDefinitionError
from ._graph import critical_path, cycle_text, graph_meta
from ._retry import ExceptionTypes, Retry
from ._tool import Tool, is_async_callable

if TYPE_CHECKING:
    from ._llm import LLM
    from ._observe import Observer
    from ._result import RunEvent, RunResult
    from ._run_stream import RunStream
    from ._stall import StallHook

F = TypeVar("F", bound=Callable[..., Any])
Ref = str | Callable[..., Any] | Tool

#: Predicted decode time per output token when an agent gives no ``predict_llm_s``.
SECONDS_PER_TOKEN = 0.02
#: Output tokens assumed for an agent without ``max_tokens`` (for the prediction only).
ASSUMED_MAX_TOKENS = 256
_MAX_NAME = 100
#: The keyword options of ``run`` / ``run_sync`` / ``stream`` (any other keyword must be a declared input).
RUN_OPTIONS = ("llm", "stall", "timeout", "max_concurrency", "run_id", "observer")


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


@dataclass(frozen=True)
class _Analysis:
    graph: nx.DiGraph
    metas: dict[str, GraphMeta]
    weights: dict[str, float]
    critical_path: list[str]
    critical_path_s: float
    calls: dict[str, list[str]]
    tools: dict[str, list[str]]


class App:
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
        self._analysis_cache: _Analysis | None = None

    # ------------------------------------------------------------------ declaration

    @overload
    def agent(self, fn: F, /) -> F: ...
    @overload
    def agent(self, fn: None = None, /, **options: Any) -> Callable[[F], F]: ...

    def agent(self, fn: F | None = None, /, **options: Any) -> F | Callable[[F], F]:
        """Decorator: declare an LLM agent ``async def fn(ctx, inputs)``.

        Options: ``name``, ``system``, ``max_tokens``, ``temperature``, ``extra_body`` (request
        fields for every call, e.g. sampling options), ``after`` (dependencies),
        ``tools`` (model-driven tools offered to ``ctx.llm``), ``calls`` (graph-fixed tools, for the
        prediction), ``importance``, ``agent_type``, ``predict_llm_s``, ``description``,
        ``template`` (not a DAG node: ``ctx.fan_out`` runs instances of it).
        """
        return self._decorate(self.add_agent, fn, options)

    @overload
    def function(self, fn: F, /) -> F: ...
    @overload
    def function(self, fn: None = None, /, **options: Any) -> Callable[[F], F]: ...

    def function(self, fn: F | None = None, /, **options: Any) -> F | Callable[[F], F]:
        """Decorator: declare a local node ``fn(ctx, inputs)`` (sync functions run in a thread).

        Options: ``name``, ``after``, ``calls``, ``predict_s`` (its own compute seconds), ``description``,
        ``template``.
        """
        return self._decorate(self.add_function, fn, options)

    @overload
    def tool(self, fn: F, /) -> F: ...
    @overload
    def tool(self, fn: None = None, /, **options: Any) -> Callable[[F], F]: ...

    def tool(self, fn: F | None = None, /, **options: Any) -> F | Callable[[F], F]:
        """Decorator: declare a tool (sync or async). The function is returned unchanged.

        Options: ``name``, ``predict_time`` (seconds), ``stages`` ({name: seconds}), ``kind``,
        ``timeout`` (seconds per attempt), ``retries`` (extra attempts, or a :class:`Retry`),
        ``retry_on`` (exception types worth a retry), ``description``. The :class:`Tool` (schema,
        policy) is ``app.get_tool(fn)``.
        """
        return self._decorate(self.add_tool, fn, options)

    @staticmethod
    def _decorate(add: Callable[..., Any], fn: F | None, options: dict[str, Any]) -> F | Callable[[F], F]:
        def register(f: F) -> F:
            add(f, **options)
            return f

        return register(fn) if fn is not None else register

    def add_agent(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        extra_body: Mapping[str, Any] | None = None,
        after: Iterable[Ref] = (),
        tools: Iterable[Ref] = (),
        calls: Iterable[Ref] = (),
        importance: float = 1.0,
        agent_type: str | None = None,
        predict_llm_s: float | None = None,
        description: str | None = None,
        template: bool = False,
    ) -> Node:
        """Imperative form of ``@app.agent``; returns the node."""
        node = Node(
            name=name or _fn_name(fn),
            fn=fn,
            kind="agent",
            after=_refs(after),
            calls=_refs(calls),
            tools=_refs(tools),
            system=system,
            max_tokens=max_tokens,
            temperature=temperature,
            extra_body=_extra_body(extra_body),
            importance=importance,
            agent_type=agent_type,
            predict_llm_s=predict_llm_s,
            description=description if description is not None else inspect.getdoc(fn) or "",
            template=template,
        )
        return self._add_node(node)

    def add_function(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        after: Iterable[Ref] = (),
        calls: Iterable[Ref] = (),
        predict_s: float | None = None,
        description: str | None = None,
        template: bool = False,
    ) -> Node:
        """Imperative form of ``@app.function``; returns the node."""
        node = Node(
            name=name or _fn_name(fn),
            fn=fn,
            kind="function",
            after=_refs(after),
            calls=_refs(calls),
            predict_s=predict_s,
            description=description if description is not None else inspect.getdoc(fn) or "",
            template=template,
        )
        return self._add_node(node)

    def add_tool(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        predict_time: float | None = None,
        kind: str = "tool",
        stages: dict[str, float] | None = None,
        timeout: float | None = None,
        retries: int | Retry = 0,
        retry_on: type[BaseException] | ExceptionTypes | None = None,
        description: str | None = None,
    ) -> Tool:
        """Imperative form of ``@app.tool``; returns the :class:`Tool`."""
        tool_name = name or _fn_name(fn)
        self._check_new_name(tool_name, "tool")
        tool = Tool(
            name=tool_name,
            fn=fn,
            predict_time=predict_time,
            kind=kind,
            stages=stages,
            timeout=timeout,
            retries=retries,
            retry_on=retry_on,
            description=description or "",
        )
        self.tools[tool.name] = tool
        self._tool_fns.setdefault(id(fn), tool.name)
        self._changed()
        return tool

    def link(self, src: Ref, dst: Ref) -> None:
        """Add the edge ``src -> dst`` (``dst`` runs after ``src``)."""
        dst_name = self._node_ref(dst, "link target")
        if dst_name not in self.nodes:
            what = "a template (templates have no edges)" if dst_name in self.templates else "unknown node"
            raise AppDefinitionError(f"link: {what} {dst_name!r}")
        self.nodes[dst_name].after.append(src)
        self._changed()

    def _add_node(self, node: Node) -> Node:
        self._check_new_name(node.name, node.kind)
        problems = []
        if node.kind == "agent" and not node.is_async:
            problems.append(
                f"agent {node.name!r} must be an async function (async def {node.name}(ctx, inputs))"
            )
        try:
            inspect.signature(node.fn).bind(None, None)
        except TypeError:
            problems.append(f"{node.kind} {node.name!r} must accept two arguments (ctx, inputs)")
        except ValueError:
            pass  # builtins without a signature: trust the caller
        if not (isinstance(node.importance, int | float) and math.isfinite(node.importance)):
            problems.append(f"{node.kind} {node.name!r}: importance must be a finite number")
        for opt in ("predict_llm_s", "predict_s"):
            v = getattr(node, opt)
            if v is not None and not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                problems.append(f"{node.kind} {node.name!r}: {opt} must be a finite number >= 0")
        if node.agent_type is None:
            # The server learns tool durations per (agent_type, tool): qualify the default with the
            # app's name, so two apps' same-named nodes on one server keep separate forecasts (an
            # explicit agent_type is a deliberate, shared type).
            node.agent_type = f"{self.name}.{node.name}"
            if len(node.agent_type) > 200:
                problems.append(
                    f"{node.kind} {node.name!r}: app and node names exceed 200 characters; set agent_type="
                )
        elif not (isinstance(node.agent_type, str) and len(node.agent_type) <= 200):
            problems.append(f"{node.kind} {node.name!r}: agent_type must be a string of <= 200 characters")
        if node.max_tokens is not None and not (isinstance(node.max_tokens, int) and node.max_tokens > 0):
            problems.append(f"{node.kind} {node.name!r}: max_tokens must be a positive int")
        if node.template and node.after:
            problems.append(
                f"template {node.name!r} cannot have after= (it runs when a node calls ctx.fan_out)"
            )
        if problems:
            raise AppDefinitionError(problems)
        (self.templates if node.template else self.nodes)[node.name] = node
        self._node_fns.setdefault(id(node.fn), node.name)
        self._changed()
        return node

    def _check_new_name(self, name: str, kind: str) -> None:
        if not isinstance(name, str) or not name or len(name) > _MAX_NAME:
            raise AppDefinitionError(f"{kind} name {name!r} must be a string of 1..{_MAX_NAME} characters")
        if name in self.nodes:
            other = self.nodes[name].kind
            raise AppDefinitionError(f"duplicate name {name!r}: already a {other} of app {self.name!r}")
        if name in self.templates:
            raise AppDefinitionError(f"duplicate name {name!r}: already a template of app {self.name!r}")
        if name in self.tools:
            raise AppDefinitionError(f"duplicate name {name!r}: already a tool of app {self.name!r}")

    def _changed(self) -> None:
        self._analysis_cache = None

    # ------------------------------------------------------------------ references

    def _node_ref(self, ref: Ref, what: str) -> str:
        if isinstance(ref, str):
            return ref
        if isinstance(ref, Tool):
            return ref.name
        name = self._node_fns.get(id(ref))
        if name is None:
            raise AppDefinitionError(f"{what}: function {_fn_name(ref)!r} is not a node of app {self.name!r}")
        return name

    def _tool_ref(self, ref: Ref) -> str | None:
        if isinstance(ref, str):
            return ref
        if isinstance(ref, Tool):
            return ref.name
        return self._tool_fns.get(id(ref))

    def get_tool(self, ref: Ref) -> Tool:
        """The app's tool for a name, function or Tool; ``KeyError`` naming it otherwise."""
        name = self._tool_ref(ref)
        if name is None or name not in self.tools:
            shown = name or _fn_name(ref)
            known = ", ".join(self.tools) or "-"
            raise KeyError(f"{shown!r} is not a tool of app {self.name!r} (tools: {known})")
        return self.tools[name]

    def get_template(self, ref: Ref) -> Node:
        """The template node for a name or function; ``KeyError`` naming it otherwise."""
        name = ref if isinstance(ref, str) else self._node_fns.get(id(ref)) or _fn_name(ref)
        if name not in self.templates:
            known = ", ".join(self.templates) or "-"
            hint = " (a DAG node, not a template)" if name in self.nodes else ""
            raise KeyError(f"{name!r} is not a template of app {self.name!r}{hint} (templates: {known})")
        return self.templates[name]

    # ------------------------------------------------------------------ analysis

    def validate(self) -> None:
        """Check the whole declaration; raises :class:`AppDefinitionError` listing every problem."""
        self._analysis()

    def _analysis(self) -> _Analysis:
        if self._analysis_cache is not None:
            return self._analysis_cache
        problems: list[str] = []
        if not self.nodes:
            problems.append(f"app {self.name!r} has no nodes")
        graph = nx.DiGraph()
        calls: dict[str, list[str]] = {}
        tools: dict[str, list[str]] = {}
        for node in self.nodes.values():
            graph.add_node(node.name)
        for node in self.nodes.values():
            for ref in node.after:
                try:
                    dep = self._node_ref(ref, f"{node.kind} {node.name!r} depends on")
                except AppDefinitionError as exc:
                    problems.extend(exc.problems)
                    continue
                if dep in self.nodes:
                    graph.add_edge(dep, node.name)
                elif dep in self.templates:
                    problems.append(
                        f"{node.kind} {node.name!r} depends on {dep!r}, a template (run it with ctx.fan_out)"
                    )
                elif dep in self.tools:
                    problems.append(f"{node.kind} {node.name!r} depends on {dep!r}, a tool, not a node")
                else:
                    problems.append(f"{node.kind} {node.name!r} depends on unknown node {dep!r}")
        for node in [*self.nodes.values(), *self.templates.values()]:
            for attr, out in (("calls", calls), ("tools", tools)):
                names = []
                for ref in getattr(node, attr):
                    tool = self._tool_ref(ref)
                    if tool is None or tool not in self.tools:
                        shown = tool or _fn_name(ref)
                        problems.append(f"{node.kind} {node.name!r} lists unknown tool {shown!r} in {attr}=")
                    else:
                        names.append(tool)
                out[node.name] = names
        cycle = cycle_text(graph)
        if cycle:
            problems.append(f"cycle: {cycle}")
        if problems:
            raise AppDefinitionError(problems)
        every = {**self.nodes, **self.templates}
        weights = {name: self._weight(node, calls[name]) for name, node in every.items()}
        path, length = critical_path(graph, weights)
        metas = graph_meta(graph, weights)
        for name, node in self.nodes.items():
            graph.nodes[name].update(
                kind=node.kind,
                fn=node.fn,
                options=node.options(),
                calls=calls[name],
                tools=tools[name],
                weight_s=weights[name],
                meta=metas[name],
                **metas[name].model_dump(),
            )
        self._analysis_cache = _Analysis(graph, metas, weights, path, length, calls, tools)
        return self._analysis_cache

    def _weight(self, node: Node, calls: list[str]) -> float:
        tool_s = sum(self.tools[c].predicted_s or 0.0 for c in calls)
        if node.kind == "function":
            return (node.predict_s or 0.0) + tool_s
        if node.predict_llm_s is not None:
            return node.predict_llm_s + tool_s
        return (node.max_tokens or ASSUMED_MAX_TOKENS) * SECONDS_PER_TOKEN + tool_s

    @property
    def graph(self) -> nx.DiGraph:
        """The validated DAG; node attributes: kind, fn, options, calls, tools, weight_s, meta and
        the :class:`~tokencake.events.GraphMeta` fields. Do not mutate it: use ``link``/``add_*``."""
        return self._analysis().graph

    def meta(self, node: Ref) -> GraphMeta:
        """The graph metadata of ``node`` (sent with each of its LLM requests)."""
        name = self._node_ref(node, "meta")
        metas = self._analysis().metas
        if name not in metas:
            raise KeyError(f"{name!r} is not a node of app {self.name!r}")
        return metas[name]

    def weight(self, node: Ref) -> float:
        """Predicted seconds of ``node``: LLM time (``predict_llm_s`` or ``max_tokens`` x 0.02 s)
        plus the ``predict_time`` of the tools in its ``calls``."""
        return self._analysis().weights[self._node_ref(node, "weight")]

    @property
    def critical_path(self) -> list[str]:
        """The longest path by predicted seconds (ties broken by node name)."""
        return list(self._analysis().critical_path)

    @property
    def critical_path_s(self) -> float:
        return self._analysis().critical_path_s

    @property
    def sinks(self) -> list[str]:
        graph = self.graph
        return [n for n in self.nodes if graph.out_degree(n) == 0]

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


def _fn_name(fn: Any) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _extra_body(extra_body: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A node's ``extra_body`` option, checked at declaration (a JSON object's fields)."""
    if extra_body is None:
        return None
    if not isinstance(extra_body, Mapping) or not all(isinstance(k, str) for k in extra_body):
        raise AppDefinitionError("extra_body must be a mapping of request field names to values")
    return dict(extra_body)


def _refs(refs: Iterable[Ref] | Ref) -> list[Ref]:
    if isinstance(refs, str | Tool) or callable(refs):
        return [refs]  # a single reference given without a list
    return list(refs)
