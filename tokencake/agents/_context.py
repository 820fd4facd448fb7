"""``Context``: what a node function uses to talk to the model and call tools.

One ``Context`` per node per run. It owns the node's conversation (so consecutive ``ctx.llm`` calls
continue one session whose KV the server can keep) and wraps every tool attempt in stall events.
The public methods live here; each mechanism is one part it builds on:

- :mod:`._structured`: ``output_type=`` validation and retries;
- :mod:`._conversation`: the node's messages, session rules and the model-driven loop;
- :mod:`._llm_request`: one request (metadata, retries, events, timings);
- :mod:`._tool_turn`: one model turn's tool calls, concurrently;
- :mod:`._tool_run`: one tool call as stalls, with the tool's retries;
- :mod:`._context_state`: the node's identity and session state.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from pydantic import BaseModel

from ._context_state import Message
from ._conversation import LLMCall
from ._errors import ToolError
from ._llm import LLMReply
from ._llm_stream import LLMStream
from ._output import check_output_type
from ._retry import Retry, as_retry
from ._structured import M, StructuredOutput

if TYPE_CHECKING:
    from ._node import Ref


class Context(StructuredOutput):
    """The handle a node function receives as ``ctx``.

    ``inputs`` are the run inputs (read-only); ``messages`` is the node's conversation so far.
    ``parent`` is the node that spawned this one with :meth:`fan_out` (None for DAG nodes).
    """

    # ------------------------------------------------------------------ LLM

    @overload
    def llm(
        self,
        prompt: str | Sequence[Message],
        *,
        system: str | None = ...,
        max_tokens: int | None = ...,
        temperature: float | None = ...,
        tools: Sequence[Ref] | None = ...,
        max_turns: int = ...,
        stop: str | list[str] | None = ...,
        extra_body: Mapping[str, Any] | None = ...,
        new_session: bool = ...,
        stream: Literal[False] = ...,
        output_type: None = ...,
        output_retries: int = ...,
        retry: Retry | int | None = ...,
    ) -> Awaitable[LLMReply]: ...
    @overload
    def llm(
        self,
        prompt: str | Sequence[Message],
        *,
        system: str | None = ...,
        max_tokens: int | None = ...,
        temperature: float | None = ...,
        tools: Sequence[Ref] | None = ...,
        max_turns: int = ...,
        stop: str | list[str] | None = ...,
        extra_body: Mapping[str, Any] | None = ...,
        new_session: bool = ...,
        stream: Literal[False] = ...,
        output_type: type[M],
        output_retries: int = ...,
        retry: Retry | int | None = ...,
    ) -> Awaitable[M]: ...
    @overload
    def llm(
        self,
        prompt: str | Sequence[Message],
        *,
        system: str | None = ...,
        max_tokens: int | None = ...,
        temperature: float | None = ...,
        tools: Sequence[Ref] | None = ...,
        max_turns: int = ...,
        stop: str | list[str] | None = ...,
        extra_body: Mapping[str, Any] | None = ...,
        new_session: bool = ...,
        stream: Literal[True],
        output_type: None = ...,
        output_retries: int = ...,
        retry: Retry | int | None = ...,
    ) -> LLMStream: ...

    def llm(
        self,
        prompt: str | Sequence[Message],
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        tools: Sequence[Ref] | None = None,
        max_turns: int = 8,
        stop: str | list[str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        new_session: bool = False,
        stream: bool = False,
        output_type: type[BaseModel] | None = None,
        output_retries: int = 2,
        retry: Retry | int | None = None,
    ) -> Awaitable[Any] | LLMStream:
        """Send ``prompt`` (text, or messages to append) in this node's conversation.

        ``system``, ``max_tokens``, ``temperature`` and ``extra_body`` default to the node's
        options (``extra_body``: the node's fields, then the call's). With tools
        (``tools=`` or the node's ``tools``) the model-driven loop runs: the tool calls of one
        turn are validated and executed concurrently (each its own stall) and their results sent
        back in the model's order, for at most ``max_turns`` requests; the last request forbids
        tools (``tool_choice="none"``). A :class:`ToolError` (bad arguments, timeout, or raised by
        the tool) goes back to the model as the tool's reply.

        ``await ctx.llm(...)`` returns the :class:`LLMReply`. ``stream=True`` returns an
        :class:`LLMStream` of text deltas instead. ``output_type=Model`` (a pydantic model) asks for
        JSON matching it, validates the reply, sends the validation error back for at most
        ``output_retries`` more replies, and returns the model instance (else raises
        :class:`OutputValidationError`). ``retry`` (a :class:`Retry` or a number of retries)
        retries failed requests with backoff; it defaults to the LLM's ``retry``.
        """
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError("max_turns must be an int >= 1")
        if not isinstance(output_retries, int) or output_retries < 0:
            raise ValueError("output_retries must be an int >= 0")
        policy = as_retry(retry, what="retry") if retry is not None else self._state.llm.retry
        call = LLMCall(
            system, max_tokens, temperature, tools, max_turns, stop, extra_body, new_session, policy
        )
        if stream:
            if output_type is not None:
                raise TypeError("ctx.llm(): stream=True cannot be combined with output_type=")
            return LLMStream(self._conversation(prompt, call, stream=True))
        if output_type is not None:
            return self._structured(prompt, call, check_output_type(output_type), output_retries)
        return self._complete(prompt, call)

    # ------------------------------------------------------------------ tools

    async def call(self, tool: Ref, /, **kwargs: Any) -> Any:
        """Call a tool of the app with keyword arguments (graph-fixed call, stall-wrapped).

        Arguments are validated first (:class:`ToolArgumentsError` naming the tool); the tool's own
        exception propagates after its retries; a timeout raises :class:`ToolTimeout`.
        """
        try:
            resolved = self._tool(tool)
        except KeyError as exc:
            raise ToolError(str(exc.args[0]), tool=str(tool)) from None
        args = resolved.validate(kwargs)
        calls = self._state.calls[self.node]
        if resolved.name in calls[self._next_call :]:
            self._next_call = calls.index(resolved.name, self._next_call) + 1
        return await self._run_tool(resolved, args)

    # ------------------------------------------------------------------ fan-out

    async def fan_out(
        self, template: Ref, items: Iterable[Any], *, max_concurrency: int | None = None
    ) -> list[Any]:
        """Run template node ``template`` once per item, concurrently, and return their outputs in order.

        Each instance is a node of its own (``template[k]``: own conversation, session, timings,
        events) that receives its item as ``inputs``; it joins back into this node. While it waits,
        this node gives its ``max_concurrency`` slot to the instances. The first instance that
        raises cancels the others and its exception is raised here.
        """
        return await self._state.fan_out(self, template, list(items), max_concurrency)
