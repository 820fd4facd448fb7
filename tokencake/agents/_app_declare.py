"""Declaring an app: the ``@app.agent`` / ``@app.function`` / ``@app.tool`` decorators, their
imperative forms, each declaration's own checks, and resolving references to nodes and tools."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, overload

from ._errors import AppDefinitionError
from ._node import Node, Ref, fn_name
from ._retry import ExceptionTypes, Retry
from ._tool import Tool

F = TypeVar("F", bound=Callable[..., Any])
_MAX_NAME = 100


class AppDeclarations:
    """The app's definitions (``nodes``, ``templates``, ``tools``) and the methods that add them.

    ``App.__init__`` sets the attributes; every change calls :meth:`_changed`.
    """

    name: str
    nodes: dict[str, Node]
    templates: dict[str, Node]
    tools: dict[str, Tool]
    _node_fns: dict[int, str]
    _tool_fns: dict[int, str]

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
            name=name or fn_name(fn),
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
            name=name or fn_name(fn),
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
        tool_name = name or fn_name(fn)
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
        """Called after every change to the declaration (the graph analysis drops its cache)."""

    # ------------------------------------------------------------------ references

    def _node_ref(self, ref: Ref, what: str) -> str:
        if isinstance(ref, str):
            return ref
        if isinstance(ref, Tool):
            return ref.name
        name = self._node_fns.get(id(ref))
        if name is None:
            raise AppDefinitionError(f"{what}: function {fn_name(ref)!r} is not a node of app {self.name!r}")
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
            shown = name or fn_name(ref)
            known = ", ".join(self.tools) or "-"
            raise KeyError(f"{shown!r} is not a tool of app {self.name!r} (tools: {known})")
        return self.tools[name]

    def get_template(self, ref: Ref) -> Node:
        """The template node for a name or function; ``KeyError`` naming it otherwise."""
        name = ref if isinstance(ref, str) else self._node_fns.get(id(ref)) or fn_name(ref)
        if name not in self.templates:
            known = ", ".join(self.templates) or "-"
            hint = " (a DAG node, not a template)" if name in self.nodes else ""
            raise KeyError(f"{name!r} is not a template of app {self.name!r}{hint} (templates: {known})")
        return self.templates[name]


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
