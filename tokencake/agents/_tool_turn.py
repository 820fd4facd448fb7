"""The tool calls of one model turn: validated, run concurrently (each its own stall), replied in order."""

from __future__ import annotations

import json
from typing import Any

import anyio
from pydantic import BaseModel

from ._errors import ToolError
from ._llm import ToolCall
from ._result import jsonable
from ._tool import Tool
from ._tool_run import ToolRunner


class ToolTurn(ToolRunner):
    """Runs the tool calls the model asked for in one turn and turns their results into replies."""

    async def _tool_calls(self, calls: list[ToolCall], by_name: dict[str, Tool]) -> list[str]:
        """Run one turn's tool calls concurrently; their replies in the model's order.

        A failure that must fail the node (not a :class:`ToolError`) cancels the other calls and
        is raised as it is (the first one in the model's order).
        """
        if len(calls) == 1:
            return [await self._model_tool_call(calls[0], by_name)]
        contents = [""] * len(calls)
        failures: list[tuple[int, Exception]] = []

        async def one(index: int, call: ToolCall) -> None:
            try:
                contents[index] = await self._model_tool_call(call, by_name)
            except Exception as exc:
                failures.append((index, exc))
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            for index, call in enumerate(calls):
                tg.start_soon(one, index, call, name=f"tokencake tool {call.name}")
        if failures:
            raise min(failures, key=lambda f: f[0])[1]
        return contents

    async def _model_tool_call(self, call: ToolCall, by_name: dict[str, Tool]) -> str:
        tool = by_name.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; available tools: {', '.join(by_name)}"
        if call.raw_arguments is not None:
            got = call.raw_arguments[:200]
            return f"error: arguments for {call.name!r} must be a JSON object, got: {got}"
        try:
            args = tool.validate(call.arguments)
            value = await self._run_tool(tool, args, call_id=call.id)
        except ToolError as exc:
            return f"error: {exc}"
        return tool_content(value)


def tool_content(value: Any) -> str:
    """A tool's return value as the text of a tool message."""
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    try:
        return json.dumps(jsonable(value), ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)
