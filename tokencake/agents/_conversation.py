"""A node's conversation: its messages and session rules, and the model-driven loop of ``ctx.llm``."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._context_state import Message
from ._errors import ToolError
from ._llm import LLMReply, Usage
from ._llm_request import LLMRequests
from ._retry import Retry
from ._tool_turn import ToolTurn

if TYPE_CHECKING:
    from ._node import Ref


@dataclass(frozen=True)
class LLMCall:
    """The options of one ``ctx.llm`` call."""

    system: str | None
    max_tokens: int | None
    temperature: float | None
    tools: Sequence[Ref] | None
    max_turns: int
    stop: str | list[str] | None
    extra_body: Mapping[str, Any] | None
    new_session: bool
    retry: Retry | None
    response_format: Mapping[str, Any] | None = None


class Conversation(LLMRequests, ToolTurn):
    """Appends prompts to the node's messages and runs requests and tool turns until the model answers."""

    async def _complete(self, prompt: str | Sequence[Message], call: LLMCall) -> LLMReply:
        reply: LLMReply | None = None
        async with aclosing(self._conversation(prompt, call, stream=False)) as items:
            async for item in items:
                if isinstance(item, LLMReply):
                    reply = item
        assert reply is not None
        return reply

    async def _conversation(
        self, prompt: str | Sequence[Message], call: LLMCall, *, stream: bool
    ) -> AsyncGenerator[str | LLMReply, None]:
        """The model-driven loop: yields text deltas (when streaming), then the final reply."""
        self._append_prompt(prompt, call)
        offered = [self._tool(t) for t in (call.tools if call.tools is not None else self._node.tools)]
        by_name = {t.name: t for t in offered}
        schemas = [t.openai_schema() for t in offered]
        usage = Usage()
        latency = 0.0
        turns = 0
        while True:
            turns += 1
            last = turns >= call.max_turns
            reply: LLMReply | None = None
            parts: list[str] = []
            try:
                async with aclosing(
                    self._request(
                        schemas,
                        offered,
                        stream=stream,
                        policy=call.retry,
                        tool_choice="none" if (schemas and last) else None,
                        max_tokens=call.max_tokens if call.max_tokens is not None else self._node.max_tokens,
                        temperature=call.temperature
                        if call.temperature is not None
                        else self._node.temperature,
                        stop=call.stop,
                        extra_body={**(self._node.extra_body or {}), **(call.extra_body or {})} or None,
                        response_format=None if schemas else call.response_format,
                    )
                ) as items:
                    async for item in items:
                        if isinstance(item, LLMReply):
                            reply = item
                        else:
                            parts.append(item)
                            yield item
            finally:
                if reply is None and parts:  # stopped mid-stream: keep what the model said
                    self.messages.append({"role": "assistant", "content": "".join(parts)})
            assert reply is not None
            usage = usage + reply.usage
            latency += reply.latency_s
            self.messages.append(reply.message())
            if not reply.tool_calls or not schemas:
                reply.usage, reply.turns, reply.latency_s = usage, turns, latency
                yield reply
                return
            if last:
                raise ToolError(
                    f"node {self.node!r}: the model still calls tools after max_turns={call.max_turns}",
                    tool=reply.tool_calls[0].name,
                )
            contents = await self._tool_calls(reply.tool_calls, by_name)
            for tool_call, content in zip(reply.tool_calls, contents, strict=True):
                self.messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": content})

    def _append_prompt(self, prompt: str | Sequence[Message], call: LLMCall) -> None:
        if call.new_session:
            self.messages = []
            self._session_n += 1
            self._turn = 0
        system = call.system if call.system is not None else self._node.system
        if not self.messages:
            if system:
                self.messages.append({"role": "system", "content": system})
        elif system is not None and self._system() not in (None, system):
            raise ValueError(
                f"node {self.node!r}: system= differs from this session's system prompt; "
                "pass new_session=True to start a new conversation"
            )
        if isinstance(prompt, str):
            self.messages.append({"role": "user", "content": prompt})
        else:
            self.messages.extend(dict(m) for m in prompt)

    def _system(self) -> str | None:
        if self.messages and self.messages[0].get("role") == "system":
            return self.messages[0].get("content")
        return None
