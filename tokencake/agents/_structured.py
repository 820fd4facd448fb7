"""Structured output of ``ctx.llm(output_type=...)``: ask for JSON, validate it, send the error back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar

from pydantic import BaseModel

from ._context_state import Message
from ._conversation import Conversation, LLMCall
from ._errors import OutputValidationError
from ._output import instructions, parse_output, response_format, retry_prompt

M = TypeVar("M", bound=BaseModel)


class StructuredOutput(Conversation):
    """Completes the conversation until the reply validates as ``output_type`` (or retries run out)."""

    async def _structured(
        self, prompt: str | Sequence[Message], call: LLMCall, output_type: type[M], output_retries: int
    ) -> M:
        ask = instructions(output_type)
        if isinstance(prompt, str):
            prompt = f"{prompt}\n\n{ask}"
        else:
            prompt = [*prompt, {"role": "user", "content": ask}]
        call = replace(call, response_format=response_format(output_type))
        for attempt in range(1, output_retries + 2):
            reply = await self._complete(prompt, call)
            try:
                return parse_output(output_type, reply.text)
            except ValueError as exc:
                detail = str(exc)
            if attempt > output_retries:
                raise OutputValidationError(self.node, output_type, reply.text, detail, attempt)
            prompt = retry_prompt(detail)
            call = replace(call, system=None, new_session=False)
        raise AssertionError("unreachable")
