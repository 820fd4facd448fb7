"""One LLM request of a node's conversation: its request metadata (with the next-stall hint),
retries, the ``response_format`` fallback, run events and timings."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio
import openai

from tokencake.events import NextStall, RequestMeta

from ._context_state import ContextState
from ._llm import LLMReply
from ._retry import LLM_TRANSIENT_ERRORS, Retry
from ._tool import Tool


class LLMRequests(ContextState):
    """Sends the node's requests to the run's LLM and accounts for them."""

    async def _request(
        self,
        schemas: list[dict[str, Any]],
        offered: list[Tool],
        *,
        stream: bool,
        policy: Retry | None,
        **kwargs: Any,
    ) -> AsyncIterator[str | LLMReply]:
        """One request of the conversation, retried per ``policy``; yields deltas, then the reply."""
        state, res, llm = self._state, self._result, self._state.llm
        meta = RequestMeta(
            session_id=self.session_id,
            run_id=self.run_id,
            node=self.node,
            agent_type=self.agent_type,
            turn=self._turn,
            importance=float(self._node.importance),
            graph=self.meta,
            # With tool_choice "none" the model cannot call an offered tool (only a declared call
            # in code can follow): announcing one would start a stall that never ends.
            next_stall=self._next_stall(offered if kwargs.get("tool_choice") != "none" else []),
            stall_events=state.reports_stalls,
        )
        if kwargs.get("response_format") is not None and not llm.supports_response_format:
            kwargs["response_format"] = None
        own_retries = 0 if policy is not None else None  # our policy replaces the client's retries
        dropped_format = False
        attempt = 0
        retries = 0
        while True:
            attempt += 1
            started = time.perf_counter()
            delivered = False
            finished = False
            try:
                model = await llm.resolve_model()
                state.emit(
                    "llm_started",
                    self.node,
                    session_id=self.session_id,
                    turn=meta.turn,
                    attempt=attempt,
                    model=model,
                    stream=stream,
                    max_tokens=kwargs.get("max_tokens"),
                    temperature=kwargs.get("temperature"),
                    server=llm.base_url,
                )
                reply: LLMReply | None = None
                if stream:
                    async with aclosing(
                        llm.chat_stream(
                            self.messages, meta=meta, tools=schemas, max_retries=own_retries, **kwargs
                        )
                    ) as it:
                        async for item in it:
                            if isinstance(item, LLMReply):
                                reply = item
                            else:
                                delivered = True
                                yield item
                else:
                    reply = await llm.chat(
                        self.messages,
                        meta=meta,
                        tools=schemas,
                        max_retries=own_retries,
                        **kwargs,
                    )
                assert reply is not None
                finished = True
            except Exception as exc:
                res.llm_s += time.perf_counter() - started
                res.llm_calls += 1
                finished = True
                delay: float | None = None
                if (
                    kwargs.get("response_format") is not None
                    and isinstance(exc, openai.BadRequestError)
                    and not delivered
                ):
                    # Maybe the server does not take response_format: ask once more without it
                    # (remembered only if that works, so an unrelated 400 does not switch it off).
                    kwargs["response_format"] = None
                    dropped_format = True
                    delay = 0.0
                elif (
                    policy is not None
                    and not delivered
                    and policy.should_retry(exc, retries + 1, LLM_TRANSIENT_ERRORS)
                ):
                    retries += 1
                    delay = policy.delay(retries)
                state.emit(
                    "llm_failed",
                    self.node,
                    session_id=self.session_id,
                    turn=meta.turn,
                    attempt=attempt,
                    error=f"{type(exc).__name__}: {exc}"[:500],
                    retry_in_s=delay,
                )
                if delay is None:
                    raise
                await anyio.sleep(delay)
                continue
            finally:
                if not finished:  # cancelled, or the stream was closed early
                    res.llm_s += time.perf_counter() - started
                    res.llm_calls += 1
                    state.emit(
                        "llm_failed",
                        self.node,
                        session_id=self.session_id,
                        turn=meta.turn,
                        attempt=attempt,
                        error="cancelled",
                        retry_in_s=None,
                    )
            break
        if dropped_format:
            llm.supports_response_format = False
        res.llm_s += time.perf_counter() - started
        res.llm_calls += 1
        self._turn += 1
        res.usage = res.usage + reply.usage
        state.emit(
            "llm_finished",
            self.node,
            session_id=self.session_id,
            turn=meta.turn,
            latency_s=reply.latency_s,
            finish_reason=reply.finish_reason,
            prompt_tokens=reply.usage.prompt_tokens,
            completion_tokens=reply.usage.completion_tokens,
            tool_calls=[c.name for c in reply.tool_calls],
            model=reply.model,
            attempt=attempt,
        )
        yield reply

    def _next_stall(self, offered: list[Tool]) -> NextStall | None:
        calls = self._state.calls[self.node]
        tool: Tool | None = None
        if self._next_call < len(calls):
            tool = self._state.app.tools[calls[self._next_call]]
        elif len(offered) == 1:
            tool = offered[0]
        elif calls and self._next_call > 0:
            # Past its declared sequence an agent that calls tools in a loop calls the last one
            # again: a hint only (the server saves the KV early; a wrong guess costs one copy).
            tool = self._state.app.tools[calls[-1]]
        if tool is None:
            return None
        return NextStall(tool=tool.name, kind=tool.kind, predicted_s=tool.predicted_s)
