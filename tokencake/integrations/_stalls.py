"""How the adapters bracket one tool call: per-tool hints, and a blocking form for sync tools.

``predicted_s`` is what lets the server decide whether moving a waiting agent's KV out pays, and
tools differ by orders of magnitude, so adapters take it (and ``kind``) per tool name. Some
frameworks also run tools synchronously (LangGraph's ``graph.invoke``); ``blocking`` drives the
same ``tc.StallScope`` from such a thread.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import tokencake as tc

#: Seconds a tool is expected to take: one number for every tool, or per tool name.
PredictedS = float | Mapping[str, float] | None
#: The stall kind (``search``, ``code``, ...): one for every tool, or per tool name.
Kind = str | Mapping[str, str]


def tool_stall(
    session: tc.Session,
    tool: str,
    *,
    predicted_s: PredictedS,
    kind: Kind,
    agent: str | None = None,
    attempt: int = 1,
) -> tc.StallScope:
    """``tc.stall`` for one call (``attempt``) of ``tool``, with that tool's hints.

    ``agent`` names the agent making the call when it is not the session's own (an agent reached by
    handoff continues the conversation's session): the server learns tool durations per agent, so
    the events carry that agent as ``node`` and ``agent_type``.
    """
    predicted = predicted_s.get(tool) if isinstance(predicted_s, Mapping) else predicted_s
    tool_kind = kind.get(tool, "tool") if isinstance(kind, Mapping) else kind
    scope = tc.stall(session, tool[:200] or "tool", kind=tool_kind, predicted_s=predicted, attempt=attempt)
    if agent and agent[:200] != scope.begin.node:
        scope.begin = scope.begin.model_copy(update={"node": agent[:200], "agent_type": agent[:200]})
    return scope


class StampCheck:
    """Warns once when a stall begins for a session whose requests carried no TokenCake metadata.

    Such a stall reaches the server, which cannot match it to any KV (the session's requests never
    named it). A conversation's first tool call follows at least one model request, so a session
    whose turn counter is still 0 at a stall was never stamped. ``fix`` says how to stamp them.
    """

    def __init__(self, fix: str) -> None:
        self.fix = fix
        self.warned = False

    def check(self, session: tc.Session, fix: str | None = None) -> None:
        """Warn (once) if ``session`` was never stamped; ``fix`` replaces the default advice."""
        if session.turn == 0:
            self.warn(
                f"a tool call of session {session.session_id!r}, whose model requests carried no "
                "TokenCake metadata: the server cannot match its stall to any KV cache. "
                f"{fix or self.fix}"
            )

    def warn(self, message: str) -> None:
        """Issue ``message`` as this check's one warning (later calls do nothing)."""
        if not self.warned:
            self.warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=3)


@contextmanager
def blocking(scope: tc.StallScope) -> Iterator[tc.StallScope]:
    """Run ``scope`` around a synchronous block: begin before it, end after it, whatever happens.

    The events are sent from one event loop on a daemon thread shared by every blocking tool of
    the process, so the block itself stays synchronous and the reporter keeps one connection
    pool (a loop per event would build a client, and open a connection, for every event).
    """
    _run(scope.__aenter__)
    try:
        yield scope
    except BaseException as exc:
        _run(scope.__aexit__, type(exc), exc, exc.__traceback__)
        raise
    _run(scope.__aexit__, None, None, None)


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _events_loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="tokencake-stall-events", daemon=True).start()
            _LOOP = loop
        return _LOOP


def _run(fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Run ``fn(*args)`` on the shared events loop and wait for it (its exception is raised here)."""
    asyncio.run_coroutine_threadsafe(_call(fn, *args), _events_loop()).result()


async def _call(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    return await fn(*args)
