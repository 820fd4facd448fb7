"""``LLMStream``: what ``ctx.llm(..., stream=True)`` returns.

The stream is the same conversation step as a plain ``ctx.llm``: tool calls still run (stall
-wrapped) between the turns and the reply is still recorded. The stream only adds that the text
of each turn arrives as it is generated.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from types import TracebackType

from ._llm import LLMReply


class LLMStream:
    """An async iterator of text deltas; afterwards :attr:`reply` holds the whole :class:`LLMReply`.

    ``async for delta in ctx.llm(prompt, stream=True)`` reads it; ``async with`` (or
    :meth:`aclose`) ends it early: the request is closed and the text received so far is
    recorded as the assistant message. :meth:`get_reply` reads the rest and returns the reply.
    """

    def __init__(self, items: AsyncGenerator[str | LLMReply, None]) -> None:
        self._items = items
        self._parts: list[str] = []
        self._done = False
        #: The whole reply once the stream is exhausted (``usage`` and ``turns`` cover all turns).
        self.reply: LLMReply | None = None

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._parts)

    def __aiter__(self) -> LLMStream:
        return self

    async def __anext__(self) -> str:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._items.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise
        except BaseException:
            self._done = True
            raise
        if isinstance(item, str):
            self._parts.append(item)
            return item
        self.reply = item
        await self.aclose()
        raise StopAsyncIteration

    async def get_reply(self) -> LLMReply:
        """Read what is left of the stream and return the whole reply."""
        async for _ in self:
            pass
        if self.reply is None:
            raise RuntimeError("the stream was closed before the reply was complete")
        return self.reply

    async def aclose(self) -> None:
        """Stop reading: closes the request; the text so far stays in the conversation."""
        self._done = True
        await self._items.aclose()

    async def __aenter__(self) -> LLMStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
