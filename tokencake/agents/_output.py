"""Structured output: ask for JSON that matches a pydantic model, then parse and validate the reply.

Two layers, because servers differ: ``response_format`` (a JSON schema the server enforces while
decoding, where it is supported) and instructions in the prompt (which every model can follow, and
which matter when tools are offered, since a schema-constrained reply could not call them).
Validation closes the loop: the error goes back to the model for a bounded number of retries.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ._schema import format_validation_error

M = TypeVar("M", bound=BaseModel)

_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n?(.*?)\n?```$", re.DOTALL)


def check_output_type(output_type: Any) -> type[BaseModel]:
    """``output_type`` if it is a pydantic model class, else ``TypeError``."""
    if not (isinstance(output_type, type) and issubclass(output_type, BaseModel)):
        raise TypeError(f"output_type must be a pydantic BaseModel subclass, got {output_type!r}")
    return output_type


def response_format(output_type: type[BaseModel]) -> dict[str, Any]:
    """The OpenAI ``response_format`` asking for JSON that matches ``output_type``."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", output_type.__name__)[:64] or "output"
    schema = output_type.model_json_schema()
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": False}}


def instructions(output_type: type[BaseModel]) -> str:
    """The prompt text that asks for the JSON object (servers without ``response_format`` need it)."""
    schema = json.dumps(output_type.model_json_schema(), separators=(",", ":"), ensure_ascii=False)
    return (
        "Answer with one JSON object and nothing else (no prose, no code fence) that matches this "
        f"JSON schema:\n{schema}"
    )


def retry_prompt(detail: str) -> str:
    """The follow-up turn after an invalid reply."""
    return f"That reply is not valid: {detail}. Answer again with only the corrected JSON object."


def parse_output(output_type: type[M], text: str) -> M:
    """Parse and validate ``text``; ``ValueError`` with a short, model-readable reason otherwise.

    Accepts the object alone, inside a code fence, or surrounded by prose.
    """
    data: Any = None
    for candidate in _candidates(text):
        try:
            data = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        break
    else:
        shown = text.strip()[:200] or "an empty reply"
        raise ValueError(f"the reply is not a JSON object (got: {shown})")
    try:
        return output_type.model_validate(data)
    except ValidationError as exc:
        raise ValueError(format_validation_error(exc)) from None


def _candidates(text: str) -> list[str]:
    stripped = text.strip()
    out = [stripped]
    fence = _FENCE.match(stripped)
    if fence:
        out.append(fence.group(1).strip())
    start, end = stripped.find("{"), stripped.rfind("}")
    if 0 <= start < end:
        out.append(stripped[start : end + 1])
    return out
