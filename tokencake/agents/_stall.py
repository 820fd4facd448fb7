"""Stall hooks: where the ``stall_begin`` / ``stall_end`` events of tool calls go.

A stall is the time an agent's KV cache sits idle on the GPU because the agent waits for a tool.
The runner sends ``begin`` right before each tool attempt and ``end`` right after it (always, also
on errors, timeouts and cancellation). Hooks must never make a tool fail: the reporter swallows
transport errors, and the runner guards custom hooks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import anyio
import httpx

from tokencake.events import EVENTS_PATH, EventAck, Outcome, StallBegin, StallEnd

from ._http import pool_limits
from ._loop import LoopLocal

log = logging.getLogger("tokencake.stall")


@runtime_checkable
class StallHook(Protocol):
    """Receives the stall events of every tool attempt."""

    async def begin(self, ev: StallBegin) -> None: ...

    async def end(self, ev: StallEnd) -> None: ...


class StallRecorder:
    """Keeps every event in memory (tests, notebooks, benchmarks)."""

    def __init__(self) -> None:
        self.events: list[StallBegin | StallEnd] = []

    async def begin(self, ev: StallBegin) -> None:
        self.events.append(ev)

    async def end(self, ev: StallEnd) -> None:
        self.events.append(ev)

    def pairs(self) -> list[tuple[StallBegin, StallEnd | None]]:
        """(begin, end) per stall in begin order; end is None while a stall is still open."""
        ends = {ev.stall_id: ev for ev in self.events if isinstance(ev, StallEnd)}
        return [(ev, ends.get(ev.stall_id)) for ev in self.events if isinstance(ev, StallBegin)]

    def clear(self) -> None:
        self.events.clear()

    def __len__(self) -> int:
        return len(self.events)


#: Delivered begins remembered for their end (a process with more open tool calls is unusual).
_MAX_OPEN_STALLS = 4096


class HttpStallReporter:
    """POSTs each event to ``{events_url}/v1/events`` (the serving extension).

    A server without the extension (404, connection refused, timeout) is not an error: the first
    failure is reported once as a ``RuntimeWarning``, every failure is counted in ``failures``, and
    after a timeout events are dropped (counted in ``dropped``) for ``cooldown_s`` so a silent host
    does not add ``timeout`` seconds to every tool call — except the end of a stall whose begin
    was delivered, which is always tried.

    Under asyncio the tool does not wait for ``stall_begin``'s round trip: the begin is posted by a
    task of its own and ``end`` waits for it before posting, so the server still sees every stall's
    begin before its end, and its end before the session's next request (the end is awaited). The
    server acts on a begin over the tool's seconds, not its first milliseconds; the round trip was
    a cost on every tool call (``docs/benchmarks.md``, no-pressure cost). Other backends await it.
    """

    def __init__(
        self,
        events_url: str,
        api_key: str | None = None,
        timeout: float = 2.0,
        *,
        cooldown_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.events_url = events_url.rstrip("/")
        self.url = self.events_url + EVENTS_PATH
        self.api_key = api_key
        self.timeout = timeout
        self.cooldown_s = cooldown_s
        self.sent = 0
        self.failures = 0
        self.rejected = 0
        self.dropped = 0
        self.last_error: str | None = None
        self.last_ack: EventAck | None = None
        self._warned = False
        self._quiet_until = 0.0
        #: Stalls whose begin the server recorded (oldest first, bounded): their end is sent even
        #: in a cooldown, or the server would hold the session's copies until the stall expires.
        self._delivered: dict[str, None] = {}
        #: Begins being posted (asyncio), by stall id: ``end`` waits for its stall's.
        self._begins: dict[str, asyncio.Task[None]] = {}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: LoopLocal[httpx.AsyncClient] = LoopLocal(
            lambda: httpx.AsyncClient(
                timeout=timeout, headers=headers, transport=transport, limits=pool_limits()
            )
        )

    async def begin(self, ev: StallBegin) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # another backend (trio): post it in line
            await self._send(ev)
            return
        self._begins[ev.stall_id] = loop.create_task(self._send(ev))
        if len(self._begins) > _MAX_OPEN_STALLS:  # ends that never came: forget the oldest
            del self._begins[next(iter(self._begins))]

    async def end(self, ev: StallEnd) -> None:
        posting = self._begins.pop(ev.stall_id, None)
        if posting is not None:
            # The server must see the begin first (and _delivered must know it). ``wait`` does not
            # raise the begin's own failure: the end is sent whatever happened to the begin.
            await asyncio.wait({posting})
            if not posting.cancelled() and posting.exception() is not None:
                exc = posting.exception()
                self._fail(f"{type(exc).__name__}: {exc}")
        await self._send(ev)

    async def _send(self, ev: StallBegin | StallEnd) -> None:
        owed = isinstance(ev, StallEnd) and self._delivered.pop(ev.stall_id, 0) is None
        if time.monotonic() < self._quiet_until and not owed:
            self.dropped += 1
            return
        try:
            with anyio.fail_after(self.timeout + 0.5):  # bound DNS/connect stalls httpx does not time
                response = await self._client.get().post(self.url, json=ev.model_dump(mode="json"))
        except (httpx.TimeoutException, TimeoutError) as exc:
            self._quiet_until = time.monotonic() + self.cooldown_s
            self._fail(f"timeout after {self.timeout:g} s ({type(exc).__name__})")
            return
        except httpx.HTTPError as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        ack = _ack(response)
        if response.status_code == 200 and ack is not None and ack.ok:
            self.sent += 1
            self.last_ack = ack
            if isinstance(ev, StallBegin):
                self._delivered[ev.stall_id] = None
                if len(self._delivered) > _MAX_OPEN_STALLS:
                    del self._delivered[next(iter(self._delivered))]
        elif ack is not None:
            # The extension is there and refused this event (unknown_stall, unauthorized, ...).
            self.rejected += 1
            self.last_ack = ack
            self._warn_once(f"stall event {ev.type} {ev.stall_id} rejected: {ack.reason} {ack.detail or ''}")
        else:
            self._fail(f"HTTP {response.status_code} from {self.url}")

    def _fail(self, why: str) -> None:
        self.failures += 1
        self.last_error = why
        log.debug("stall event not delivered to %s: %s", self.url, why)
        self._warn_once(f"stall events are not reaching {self.url} ({why}); tools run normally")

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.info(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    async def aclose(self) -> None:
        # Begins still being posted on this loop (their ends never came) finish first: each is
        # bounded by the timeout, and closing the client under them would turn them into errors.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        pending = [t for t in self._begins.values() if not t.done() and t.get_loop() is loop]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        client = self._client.current()
        if client is not None:
            await client.aclose()
        self._client.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "sent": self.sent,
            "failures": self.failures,
            "rejected": self.rejected,
            "dropped": self.dropped,
            "last_error": self.last_error,
        }


def _ack(response: httpx.Response) -> EventAck | None:
    try:
        return EventAck.model_validate(response.json())
    except Exception:
        return None


class StallHooks:
    """Fan-out to several hooks; a failing custom hook is logged, never raised into the tool."""

    def __init__(self, hooks: list[StallHook]) -> None:
        self.hooks = hooks
        self._warned: set[int] = set()

    async def begin(self, ev: StallBegin) -> None:
        for hook in self.hooks:
            try:
                await hook.begin(ev)
            except Exception as exc:
                self._report(hook, exc)

    async def end(self, ev: StallEnd) -> None:
        for hook in self.hooks:
            try:
                await hook.end(ev)
            except Exception as exc:
                self._report(hook, exc)

    def _report(self, hook: StallHook, exc: Exception) -> None:
        log.debug("stall hook %r failed", hook, exc_info=exc)
        if id(hook) not in self._warned:
            self._warned.add(id(hook))
            warnings.warn(f"stall hook {hook!r} failed: {exc!r}", RuntimeWarning, stacklevel=3)


class StallScope:
    """Brackets a block with ``stall_begin`` and ``stall_end``; the end is sent whatever happens.

    ``async with`` sends the begin event, runs the block and sends the end event in a shielded
    cancel scope, also when the block raises or is cancelled. The outcome follows from how the block
    ended (``ok``, ``error``, ``timeout`` for a ``TimeoutError``, ``cancelled``) unless :meth:`fail`
    set it. Exceptions propagate unchanged: a stall never changes what the block does.
    """

    def __init__(
        self,
        begin: StallBegin,
        send_begin: Callable[[StallBegin], Awaitable[None]],
        send_end: Callable[[StallEnd], Awaitable[None]],
    ) -> None:
        self.begin = begin
        #: The end event, once sent.
        self.end: StallEnd | None = None
        self.outcome: Outcome | None = None
        self.error: str | None = None
        #: Seconds the block ran (begin sent -> block done).
        self.duration_s = 0.0
        self._send_begin = send_begin
        self._send_end = send_end
        self._started: float | None = None

    @property
    def stall_id(self) -> str:
        return self.begin.stall_id

    def fail(self, outcome: Outcome, error: str | None = None) -> None:
        """Report ``outcome`` (e.g. an error the block caught itself) in the end event."""
        self.outcome, self.error = outcome, error

    async def __aenter__(self) -> StallScope:
        try:
            await self._send_begin(self.begin)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._started = time.perf_counter()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._started is not None:
            self.duration_s = max(0.0, time.perf_counter() - self._started)
        if self.outcome is None:
            self.outcome, self.error = _outcome(exc)
        self.end = StallEnd(
            stall_id=self.begin.stall_id,
            session_id=self.begin.session_id,
            run_id=self.begin.run_id,
            node=self.begin.node,
            tool=self.begin.tool,
            outcome=self.outcome,
            duration_s=self.duration_s,
            error=self.error[:2000] if self.error else None,
            ts=time.time(),
        )
        with anyio.CancelScope(shield=True):
            await self._send_end(self.end)


def _outcome(exc: BaseException | None) -> tuple[Outcome, str | None]:
    if exc is None:
        return "ok", None
    if isinstance(
        exc, anyio.get_cancelled_exc_class() | asyncio.CancelledError | GeneratorExit | KeyboardInterrupt
    ):
        return "cancelled", None
    detail = f"{type(exc).__name__}: {exc}"
    return ("timeout" if isinstance(exc, TimeoutError) else "error"), detail
