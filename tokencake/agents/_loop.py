"""Per-event-loop objects.

httpx/openai async clients keep connections bound to the event loop that opened them, while one
``LLM`` may serve several loops (``run_sync`` starts a new one each call). This cache hands out one
object per running loop and drops the previous loop's object.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import anyio.lowlevel

from ._errors import StrayCancellation

T = TypeVar("T")


class LoopLocal(Generic[T]):
    """Lazily create ``factory()`` once per running event loop."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._token: object | None = None
        self._value: T | None = None

    def get(self) -> T:
        token = anyio.lowlevel.current_token()
        if self._value is None or self._token != token:
            self._value = self._factory()
            self._token = token
        return self._value

    def current(self) -> T | None:
        """The object for the running loop if one was created, else None (does not create)."""
        try:
            token = anyio.lowlevel.current_token()
        except RuntimeError:
            return None
        return self._value if self._token == token else None

    def clear(self) -> None:
        self._value = None
        self._token = None


def cancelled_by_nobody() -> bool:
    """Whether the cancellation being handled now was asked for by no cancel scope.

    On asyncio a real cancellation (a cancel scope, a deadline, ``Task.cancel``) leaves the task's
    ``cancelling()`` above 0; a ``CancelledError`` that user code raised, or got from awaiting a
    future another task cancelled, does not. Left to propagate, such an error ends a task in a
    task group without counting as a failure, so a run would stop early and still report "ok".
    (Trio code cannot raise ``Cancelled`` without a scope.)
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:  # not on asyncio
        return False
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+; on 3.10 nothing is detected
    return cancelling is not None and cancelling() == 0


@contextmanager
def stray_cancellation_fails(what: str) -> Iterator[None]:
    """Around user code: a cancellation nobody asked for becomes :class:`StrayCancellation`."""
    try:
        yield
    except asyncio.CancelledError as exc:
        if cancelled_by_nobody():
            raise StrayCancellation(f"{what} raised {type(exc).__name__}") from exc
        raise
