"""Concurrent tool calls of one session share one stall: its KV chain is idle until the last returns.

The SDK runs the tool calls of one model turn concurrently, each bracketed by its own
``stall_begin`` / ``stall_end`` (``docs/events.md``). What they leave idle is one thing: the
session's context, the KV chain of its last request. So the connector and the simulator keep one
stall per session, and a call that begins while it is open joins it (:class:`StallCalls`):

* the chain is decided, offloaded and pinned once, by the stall (named by its first call's id);
* the stall's predicted return is the latest of its open calls' returns: its upload is due when
  the last of them is (``PrefetchPlanner.retime``, each call timed by its own tool's ratios);
* every call gets exactly one end or expiry, and its own duration teaches the forecast of its
  own tool; a call past its own deadline expires alone while another call still runs;
* the stall ends when its last open call ends or expires, or when the session's next request
  arrives (which ends every open call: an agent calls the model again only after its tools).

Single-threaded: each backend keeps these on its engine thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["StallCalls", "ToolCall"]


class ToolCall(NamedTuple):
    """One ``stall_begin`` as its stall keeps it (server clock)."""

    stall_id: str
    agent_type: str
    tool: str
    begin_at: float
    #: The forecast used at begin (seconds).
    predicted_s: float

    @property
    def returns_at(self) -> float:
        return self.begin_at + self.predicted_s

    @property
    def key(self) -> str:
        """Whose learned return ratios time it (``PrefetchPlanner``): agent type / tool."""
        return f"{self.agent_type}/{self.tool}"


class StallCalls:
    """The open tool calls of one stall, in begin order (see the module docstring)."""

    def __init__(self, first: ToolCall) -> None:
        self.open: dict[str, ToolCall] = {first.stall_id: first}
        #: Ids of every call that joined the stall, the first included.
        self.joined: list[str] = [first.stall_id]

    @property
    def shared(self) -> bool:
        """Whether more than one call joined (each then reports its own return to the planner)."""
        return len(self.joined) > 1

    def join(self, call: ToolCall) -> bool:
        """Add a call that began while the stall is open; True when it moves the return later."""
        later = call.returns_at > self.returns_at
        self.open[call.stall_id] = call
        self.joined.append(call.stall_id)
        return later

    def leave(self, stall_id: str) -> ToolCall | None:
        """Remove an open call (it ended or expired); None if it is not one of them."""
        return self.open.pop(stall_id, None)

    @property
    def returns_at(self) -> float:
        """The latest predicted return of the open calls (-inf when none is open)."""
        return max((c.returns_at for c in self.open.values()), default=-math.inf)

    def deadline(self, expiry: Callable[[float], float]) -> float:
        """When the last open call expires without its end (``expiry(predicted_s)`` after its begin)."""
        return max((c.begin_at + expiry(c.predicted_s) for c in self.open.values()), default=-math.inf)

    def overdue(self, now: float, expiry: Callable[[float], float]) -> list[ToolCall]:
        """Open calls past their own deadline while another open call is not: they expire alone.
        Empty when every open call is past it (then the stall itself expires)."""
        late = [c for c in self.open.values() if now >= c.begin_at + expiry(c.predicted_s)]
        return late if len(late) < len(self.open) else []

    def timings(self) -> list[tuple[float, float, str | None]]:
        """``(begin_at, predicted_s, key)`` of the open calls (``PrefetchPlanner.retime``)."""
        return [(c.begin_at, c.predicted_s, c.key) for c in self.open.values()]
