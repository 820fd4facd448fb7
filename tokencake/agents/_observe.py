"""Run observers: sync callables are called at once, async ones are awaited, in order, by one task.

A live view or a tracer must see every event in order but must never slow a node down or break
the run: async observers therefore run in a dispatcher task beside the nodes (the run returns
after they have seen ``run_finished``), and any observer failure becomes one warning.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._tool import is_async_callable

if TYPE_CHECKING:
    from ._result import RunEvent

Observer: TypeAlias = "Callable[[RunEvent], Awaitable[None] | None]"
_Item = tuple[Any, Any]  # (observer, event) to call, or (observer, awaitable) to await


class Observers:
    """The observers of one run (``observer=`` of ``run``: one callable or a sequence of them)."""

    def __init__(self, observers: Observer | Sequence[Observer] | None) -> None:
        if observers is None:
            items: list[Observer] = []
        elif callable(observers):
            items = [observers]
        elif isinstance(observers, Sequence) and not isinstance(observers, str):
            items = list(observers)
        else:
            raise TypeError(f"observer must be a callable or a sequence of callables, got {observers!r}")
        for item in items:
            if not callable(item):
                raise TypeError(f"observer {item!r} is not callable")
        self._sync = [o for o in items if not is_async_callable(o)]
        self._async = [o for o in items if is_async_callable(o)]
        self._send: MemoryObjectSendStream[_Item] | None = None
        self._warned: set[int] = set()

    def deliver(self, event: RunEvent) -> None:
        """Hand ``event`` to every observer without blocking (async ones are queued)."""
        for observer in self._sync:
            try:
                value = observer(event)
            except Exception as exc:  # a broken live view must not break the run
                self._warn(observer, exc)
                continue
            if inspect.isawaitable(value):  # e.g. a lambda that returns a coroutine
                self._queue(observer, value)
        for observer in self._async:
            self._queue(observer, event)

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Start delivering to async observers in ``tg`` (until :meth:`close`)."""
        send, receive = anyio.create_memory_object_stream[_Item](math.inf)
        self._send = send
        tg.start_soon(self._dispatch, receive, name="tokencake observers")

    def close(self) -> None:
        """No more events: the dispatcher delivers what is queued, then ends."""
        if self._send is not None:
            self._send.close()
            self._send = None

    def _queue(self, observer: Any, item: Any) -> None:
        try:
            if self._send is None:
                raise anyio.ClosedResourceError
            self._send.send_nowait((observer, item))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            _discard(item)  # outside a run (or after it was cancelled): nobody will await it

    async def _dispatch(self, receive: MemoryObjectReceiveStream[_Item]) -> None:
        try:
            async for observer, item in receive:
                try:
                    await (item if inspect.isawaitable(item) else observer(item))
                except Exception as exc:
                    self._warn(observer, exc)
        finally:
            while True:  # cancelled: drop what is left without "never awaited" warnings
                try:
                    _, item = receive.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
                _discard(item)
            receive.close()

    def _warn(self, observer: Any, exc: Exception) -> None:
        if id(observer) not in self._warned:
            self._warned.add(id(observer))
            warnings.warn(f"run observer {observer!r} failed: {exc!r}", RuntimeWarning, stacklevel=2)


def _discard(item: Any) -> None:
    close = getattr(item, "close", None)
    if inspect.iscoroutine(item) and close is not None:
        close()
