"""Turn a Python function signature + docstring into a pydantic model and a JSON schema.

The same model validates the arguments before a tool runs, whether they come from the model
(JSON text in a tool call) or from code (``ctx.call``), so both paths accept exactly the same inputs.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model


class SchemaError(TypeError):
    """The signature cannot be expressed as a JSON schema; the message names the parameter."""


_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Returns|Return|Yields|Raises|"
    r"Examples?|Notes?|Warnings?|See Also|Attributes|References)\s*:\s*$"
)
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")
_SPHINX_PARAM = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {arg: description}).

    The description is the text before the first section header; ``:param x:`` lines
    (Sphinx style) are understood as well.
    """
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    arg_indent = -1
    for raw in lines:
        line = raw.rstrip()
        stripped = line.strip()
        header = _SECTION.match(stripped) if not raw.startswith((" ", "\t")) else None
        if header:
            section, current, arg_indent = header.group(1), None, -1
            continue
        sphinx = _SPHINX_PARAM.match(stripped)
        if sphinx:
            section, current = ":param", sphinx.group(1)
            args[current] = sphinx.group(2).strip()
            continue
        if section is None:
            summary.append(stripped)
            continue
        if section in ("Args", "Arguments", "Parameters", "Params", "Keyword Args", "Keyword Arguments"):
            indent = len(line) - len(line.lstrip())
            match = _ARG_LINE.match(stripped)
            if match and (arg_indent < 0 or indent <= arg_indent):
                arg_indent = indent
                current = match.group(1).lstrip("*")
                args[current] = match.group(3).strip()
            elif current and stripped:
                args[current] = f"{args[current]} {stripped}".strip()
        elif section == ":param" and current and stripped:
            args[current] = f"{args[current]} {stripped}".strip()
    description = "\n".join(summary).strip()
    return re.sub(r"\n{3,}", "\n\n", description), args


class _ArgsBase(BaseModel):
    # Unknown arguments are an error: a model that invents a parameter should hear about it.
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=False)


def build_args_model(fn: Callable[..., Any], name: str) -> tuple[type[BaseModel], str, list[str]]:
    """Build the pydantic model of ``fn``'s parameters.

    Returns ``(model, description, positional_only_names)``. Raises :class:`SchemaError` naming the
    offending parameter when a parameter has no type hint or a type with no JSON schema.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"cannot read the signature of {name!r}: {exc}") from exc
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # NameError for unresolved forward references, among others
        raise SchemaError(f"cannot resolve the type hints of {name!r}: {exc}") from exc
    description, arg_docs = parse_docstring(inspect.getdoc(fn))
    fields: dict[str, Any] = {}
    positional_only: list[str] = []
    for pname, param in signature.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            star = "*" if param.kind is param.VAR_POSITIONAL else "**"
            raise SchemaError(f"parameter {star}{pname} of {name!r} has no JSON schema (name each parameter)")
        if pname not in hints:
            raise SchemaError(f"parameter {pname!r} of {name!r} has no type hint")
        annotation = hints[pname]
        try:
            TypeAdapter(annotation).json_schema()
        except Exception as exc:
            raise SchemaError(
                f"parameter {pname!r} of {name!r}: type {_type_name(annotation)} has no JSON schema ({exc})"
            ) from exc
        if param.kind is param.POSITIONAL_ONLY:
            positional_only.append(pname)
        default = ... if param.default is param.empty else param.default
        fields[pname] = (annotation, Field(default, description=arg_docs.get(pname) or None))
    model_name = "".join(part.capitalize() for part in re.split(r"[^0-9a-zA-Z]+", name) if part) or "Tool"
    try:
        model = create_model(f"{model_name}Args", __base__=_ArgsBase, **fields)
        model.model_json_schema()
    except Exception as exc:
        raise SchemaError(f"cannot build a schema for {name!r}: {exc}") from exc
    return model, description, positional_only


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON schema of ``model`` for the OpenAI ``tools=`` parameter (no auto titles)."""
    schema = model.model_json_schema()
    schema.pop("title", None)
    schema.pop("additionalProperties", None)
    for prop in schema.get("properties", {}).values():
        if isinstance(prop, dict):
            prop.pop("title", None)
    schema.setdefault("properties", {})
    schema["type"] = "object"
    return schema


def validate_args(model: type[BaseModel], arguments: Any) -> dict[str, Any]:
    """Validate ``arguments`` (a mapping) and return the keyword arguments to call the function with.

    Raises ``ValueError`` with a one-line, model-readable summary of every problem.
    """
    if not isinstance(arguments, dict):
        raise ValueError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    try:
        instance = model.model_validate(arguments)
    except ValidationError as exc:
        raise ValueError(format_validation_error(exc)) from exc
    return {field: getattr(instance, field) for field in type(instance).model_fields}


def format_validation_error(exc: ValidationError) -> str:
    """``a: Field required; b: Input should be a valid integer`` (short enough for a tool message)."""
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err.get("loc", ())) or "arguments"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or repr(annotation)
