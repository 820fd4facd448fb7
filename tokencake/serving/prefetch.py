"""When to bring an offloaded session's blocks back to the device, and how well that went.

Timing rule (``docs/policy.md``): for a stall that began at ``begin_at`` with forecast
``predicted_s``, the upload is due at ``begin_at + max(r_q · predicted_s − lead_s, 0)`` with
``lead_s = estimated H2D time + wait for the engine's next step + safety_margin_s``, so the blocks
are on device (or being copied) before the tool returns. ``r_q`` is the ``return_quantile`` of the
observed ratios actual / predicted duration — per (agent type, tool) once it has ``min_samples``
stalls, else over all stalls, else ``prior_ratio``: a forecast is a median at best (hints are
medians, tool times are heavy-tailed), and aiming at the median is late for half the stalls.
``return_quantile=None`` aims at the forecast itself (``r_q = 1``). A ``stall_end`` earlier than
the due time makes it due at once. Prefetched blocks are held on device until their request is
admitted (``hold_prefetched``, yielding to admissions and running requests; without it they sit
unpinned at the evictable end of the prefix cache); if they are evicted while the tool still runs,
the upload is due again (at most ``max_prefetches`` uploads per stall). If no end arrives by
``clamp(4 × predicted, 60 s, 1 h)`` the stall expires and its host pins should be released. A
stall that concurrent tool calls of one session share is timed by the last of them (``retime``).

Every stall gets exactly one classification, at the session's next request or at expiry:
``on_time`` (blocks on device when the request came), ``late`` (prefetch in flight at arrival —
demand load takes over), ``superseded_by_request`` (no prefetch had started: the request's own
load brings the chain), ``wasted`` (prefetched but evicted before use, or never used),
``unused`` (ended, never prefetched, no next request), ``expired`` (no end in time).

All times are server-side (``clock``, monotonic by default; injectable for tests) — never the
client's ``ts``, whose clock may differ. Thread-safe.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokencake.serving.stats import Histogram, quantile

__all__ = [
    "CLASSIFICATIONS",
    "Classification",
    "PlannedStall",
    "PrefetchPlanner",
    "PrefetchState",
    "kept_room",
    "miss_reason",
    "stall_expiry_s",
]

PrefetchState = Literal["waiting", "prefetching", "on_device", "evicted", "cancelled", "done"]
Classification = Literal[
    "on_time", "late", "head_only", "superseded_by_request", "wasted", "unused", "expired"
]
CLASSIFICATIONS: tuple[str, ...] = (
    "on_time",
    "late",
    "head_only",
    "superseded_by_request",
    "wasted",
    "unused",
    "expired",
)


def miss_reason(plan: PlannedStall | None, *, room_at_arrival: bool | None, deferred: int) -> str:
    """Why a stall's chain was not on device when its next request came (``readiness.missed_why``).

    ``no_room``: running and queued requests held the device at arrival; ``not_planned``: no
    predictive upload was planned; ``early_return``: the tool came back before the upload was due;
    ``deferred``: due, but the budget had no room; ``partial``: only the chain's head was uploaded;
    ``evicted``: uploaded, then lost; ``classified.<class>``: the plan was classified before this
    request came — given up (``unused``: no request within ``unused_after_s`` of the end;
    ``expired``: no end in time; ``wasted``: uploaded, never requested) or settled by an earlier
    request of the session; else the plan's state (e.g. ``prefetching``).
    """
    if room_at_arrival is False:
        return "no_room"
    if plan is None or plan.mode != "predictive":
        return "not_planned"
    if plan.state == "waiting":
        return "deferred" if deferred else "early_return"
    if plan.state in ("on_device", "evicted"):
        return "evicted" if plan.evictions else "partial"
    if plan.state == "done" and plan.classification is not None:
        return f"classified.{plan.classification}"
    return plan.state


def kept_room(due: Iterable[tuple[float, str, Callable[[], int | None]]], cap: int) -> dict[str, int]:
    """Room kept ahead of returns (``Options.return_reserve``, ``docs/policy.md`` §4): of the due
    returns ``(due_at, session, count)``, soonest due first, each keeps the blocks ``count()``
    says its chain needs (None: not known yet, skipped) while all fit in ``cap`` blocks.
    Session → blocks kept. Shared by the connector and the simulator."""
    out: dict[str, int] = {}
    total = 0
    for _at, session_id, count in sorted(due, key=lambda d: d[0]):
        kept = count()
        if kept is not None and kept > 0 and total + kept <= cap:
            out[session_id] = kept
            total += kept
    return out


def stall_expiry_s(
    predicted_s: float, *, factor: float = 4.0, min_s: float = 60.0, max_s: float = 3600.0
) -> float:
    """How long a stall may go without ``stall_end``: ``clamp(factor × predicted, min_s, max_s)``."""
    p = predicted_s if math.isfinite(predicted_s) and predicted_s > 0 else 0.0
    return min(max(factor * p, min_s), max_s)


@dataclass
class PlannedStall:
    """The prefetch plan and progress of one offloaded stall (server clock)."""

    stall_id: str
    session_id: str
    begin_at: float
    predicted_s: float
    lead_s: float
    due_at: float
    expires_at: float
    state: PrefetchState = "waiting"
    ended_at: float | None = None
    started_at: float | None = None
    done_at: float | None = None
    arrived_at: float | None = None
    #: When the session's next request arrived and began to wait for admission (its host copies
    #: are about to be loaded: they must not be released as unused while it waits).
    waiting_since: float | None = None
    #: True once the prefetch was started before the stall ended (a predictive upload).
    predictive: bool = False
    prefetches: int = 0
    evictions: int = 0
    classification: Classification | None = None
    cancel_reason: str | None = None
    #: Agent type / tool: whose return-time ratios this stall learns from and aims with.
    key: str | None = None
    #: ``predictive`` (before the return), ``at_end`` (when the tool returns) or ``none`` (never:
    #: the next request's demand load brings the blocks back); the policy's choice.
    mode: str = "predictive"
    #: The late end of the likely return: ``begin_at + r_(1-q) · predicted_s`` (the mirror of the
    #: early quantile the upload aims at; ``1 / prior_ratio`` before any history). Room kept for
    #: the return (``Options.return_reserve``) is kept from ``due_at`` until then at most.
    late_at: float = math.inf


class PrefetchPlanner:
    """Per-stall prefetch schedule + on-time/late/wasted accounting (see the module docstring)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        safety_margin_s: float = 0.05,
        expiry_factor: float = 4.0,
        expiry_min_s: float = 60.0,
        expiry_max_s: float = 3600.0,
        unused_after_s: float = 60.0,
        max_stalls: int = 4096,
        max_finished: int = 1024,
        return_quantile: float | None = None,
        prior_ratio: float = 1.0,
        min_samples: int = 5,
        ratio_window: int = 64,
        max_keys: int = 1024,
        max_prefetches: int = 2,
    ) -> None:
        if safety_margin_s < 0 or unused_after_s < 0 or max_stalls < 1 or max_finished < 1:
            raise ValueError("safety_margin_s/unused_after_s must be >= 0, max_stalls/max_finished >= 1")
        if return_quantile is not None and not 0 <= return_quantile <= 1:
            raise ValueError(f"return_quantile must be in [0, 1] or None, got {return_quantile}")
        if not (math.isfinite(prior_ratio) and prior_ratio >= 0):
            raise ValueError(f"prior_ratio must be a finite number >= 0, got {prior_ratio}")
        if min_samples < 1 or ratio_window < 1 or max_keys < 1 or max_prefetches < 1:
            raise ValueError("min_samples, ratio_window, max_keys and max_prefetches must be >= 1")
        self.return_quantile = return_quantile
        self.prior_ratio = prior_ratio
        self.min_samples = min_samples
        self.max_prefetches = max_prefetches
        #: actual / predicted duration of ended stalls, overall and per key.
        self.returns = ReturnRatios(return_quantile, prior_ratio, min_samples, ratio_window, max_keys)
        self._clock = clock
        self.safety_margin_s = safety_margin_s
        self.expiry_factor = expiry_factor
        self.expiry_min_s = expiry_min_s
        self.expiry_max_s = expiry_max_s
        self.unused_after_s = unused_after_s
        self.max_stalls = max_stalls
        self._lock = threading.Lock()
        self._stalls: OrderedDict[str, PlannedStall] = OrderedDict()
        self._finished: OrderedDict[str, PlannedStall] = OrderedDict()
        self._max_finished = max_finished
        self._counts: dict[str, int] = dict.fromkeys(CLASSIFICATIONS, 0)
        self._early_by = Histogram(512)  # on_time: seconds the blocks were ready before the request
        self._late_by = Histogram(512)  # late: seconds the request arrived before the blocks were ready

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    # -------------------------------------------------------------- lifecycle
    def begin(
        self,
        stall_id: str,
        session_id: str,
        predicted_s: float,
        h2d_s: float,
        *,
        key: str | None = None,
        wait_s: float = 0.0,
        now: float | None = None,
        mode: str = "predictive",
    ) -> PlannedStall:
        """Plan the upload for a stall whose blocks are (being) offloaded; returns a copy of the plan.

        ``key`` (agent type / tool) selects the learned return-time ratios; ``wait_s`` is how long
        a copy decided now waits for the engine to act on it (the next step boundary). ``mode``
        ``at_end`` makes the upload due only when the tool returns, ``none`` never.
        """
        if mode not in ("predictive", "at_end", "none"):
            raise ValueError(f"mode must be predictive, at_end or none, got {mode!r}")
        t = self._now(now)
        predicted = predicted_s if math.isfinite(predicted_s) and predicted_s > 0 else 0.0
        lead = _finite(h2d_s) + _finite(wait_s) + self.safety_margin_s
        with self._lock:
            due_at, late_at, expires_at = self._timing_locked(t, predicted, lead, key, mode)
        plan = PlannedStall(
            stall_id=stall_id,
            session_id=session_id,
            begin_at=t,
            predicted_s=predicted,
            lead_s=lead,
            due_at=due_at,
            key=key,
            mode=mode,
            late_at=late_at,
            expires_at=expires_at,
        )
        with self._lock:
            self._stalls[stall_id] = plan
            self._stalls.move_to_end(stall_id)
            while len(self._stalls) > self.max_stalls:
                _, old = self._stalls.popitem(last=False)
                self._classify(old, "expired")
                self._count("dropped_over_capacity")
            self._count("planned")
            return dataclasses.replace(plan)

    def retime(self, stall_id: str, calls: Sequence[tuple[float, float, str | None]]) -> PlannedStall | None:
        """The stall's open tool calls changed (concurrent calls of one session share its chain,
        ``tokencake.serving.stall_calls``): the upload is due when the last of ``calls``
        ``(begin_at, predicted_s, key)`` is, each timed as :meth:`begin` times a stall, and the
        late end and expiry are the latest of theirs. Only an upload still waiting moves; returns
        a copy of the plan, None when it is not open (or ended)."""
        with self._lock:
            plan = self._stalls.get(stall_id)
            if plan is None or plan.ended_at is not None or not calls:
                return None
            timed = [self._timing_locked(b, p, plan.lead_s, key, plan.mode) for b, p, key in calls]
            if plan.state == "waiting":
                plan.due_at = max(due for due, _late, _exp in timed)
            plan.late_at = max(late for _due, late, _exp in timed)
            plan.expires_at = max(exp for _due, _late, exp in timed)
            plan.predicted_s = max(b + _finite(p) for b, p, _key in calls) - plan.begin_at
            self._count("retimed")
            return dataclasses.replace(plan)

    def end(self, stall_id: str, *, now: float | None = None, learn: bool = True) -> PlannedStall | None:
        """The tool returned: a not-yet-started upload (or one whose blocks were evicted) is due now.

        ``learn``: the stall's return teaches the return-time ratios of its key. A stall shared
        by concurrent calls passes False and reports each call instead (:meth:`observe_return`)."""
        t = self._now(now)
        with self._lock:
            plan = self._stalls.get(stall_id)
            if plan is None or plan.ended_at is not None:
                return None
            plan.ended_at = t
            if learn:
                self.returns.learn(plan.key, plan.begin_at, plan.predicted_s, t)
            if plan.mode == "none":
                pass  # the next request loads on demand
            elif plan.state == "evicted":
                plan.state = "waiting"  # prefetched too early and lost: upload again now
                plan.due_at = t
                self._count("reprefetch_after_eviction")
            elif plan.state == "waiting" and plan.mode == "at_end":
                plan.due_at = t
                self._count("due_at_end")
            elif plan.state == "waiting" and plan.due_at > t:
                plan.due_at = t
                self._count("early_end")
            elif t > plan.begin_at + plan.predicted_s:
                self._count("late_end")
            return dataclasses.replace(plan)

    def due(self, now: float | None = None) -> list[str]:
        """Stalls whose upload should start now (state ``waiting``, ``due_at <= now``), earliest first."""
        t = self._now(now)
        with self._lock:
            ready = [p for p in self._stalls.values() if p.state == "waiting" and p.due_at <= t]
            ready.sort(key=lambda p: p.due_at)
            return [p.stall_id for p in ready]

    def mark_started(self, stall_id: str, *, now: float | None = None) -> None:
        """The upload was issued (blocks allocated on device, copy queued)."""
        t = self._now(now)
        with self._lock:
            plan = self._stalls.get(stall_id)
            if plan is None or plan.state != "waiting":
                return
            plan.state, plan.started_at = "prefetching", t
            plan.prefetches += 1
            plan.predictive = plan.predictive or plan.ended_at is None
            self._count("started")
            self._count("started_predictive" if plan.ended_at is None else "started_after_end")

    def mark_done(self, stall_id: str, *, now: float | None = None) -> None:
        """The uploaded blocks are on device and registered in the prefix cache."""
        t = self._now(now)
        with self._lock:
            plan = self._stalls.get(stall_id) or self._finished.get(stall_id)
            if plan is None or plan.state != "prefetching":
                return
            plan.done_at = t
            if plan.classification == "late" and plan.arrived_at is not None:
                self._late_by.add(t - plan.arrived_at)
                plan.state = "done"
                return
            plan.state = "on_device"
            self._count("completed")

    def mark_evicted(self, stall_id: str, *, now: float | None = None, retry: bool = True) -> None:
        """Prefetched blocks left the device again before the next request used them.

        While the tool still runs, the upload is due again at once (up to ``max_prefetches``
        uploads per stall: a cache that keeps evicting them is not chased forever); after that,
        or once the tool has returned (``retry=False``: the caller ends it next), ``end`` makes it due.
        """
        t = self._now(now)
        with self._lock:
            plan = self._stalls.get(stall_id)
            if plan is None or plan.state != "on_device":
                return
            plan.evictions += 1
            self._count("evicted_before_use")
            if retry and plan.ended_at is None and plan.prefetches < self.max_prefetches:
                plan.state, plan.due_at = "waiting", t
                self._count("reprefetch_while_running")
            else:
                plan.state = "evicted"

    def cancel(self, stall_id: str, reason: str) -> None:
        """Stop planning (offload failed, blocks still on device, prefetch failed); no classification."""
        with self._lock:
            plan = self._stalls.pop(stall_id, None)
            if plan is None:
                return
            plan.state, plan.cancel_reason = "cancelled", reason
            self._remember(plan)
            self._count(f"cancelled.{reason}")

    def on_request(
        self,
        session_id: str,
        *,
        hit_on_device: bool | None = None,
        partial: bool = False,
        now: float | None = None,
    ) -> list[tuple[str, Classification]]:
        """Classify the session's open stalls when its next request arrives.

        ``hit_on_device=False`` says the prefix was *not* found on device (a prefetch that had
        completed was evicted meanwhile → ``wasted``); ``partial``: the budget let the upload
        bring only the chain's head and no top-up had room since (→ ``head_only``). Returns
        ``[(stall_id, classification)]``; the stalls leave the plan (release their host pins
        after the request loaded).
        """
        t = self._now(now)
        out: list[tuple[str, Classification]] = []
        with self._lock:
            for sid in [s for s, p in self._stalls.items() if p.session_id == session_id]:
                plan = self._stalls.pop(sid)
                plan.arrived_at = t
                if plan.state == "on_device" and hit_on_device is not False:
                    cls: Classification = "on_time"
                    if plan.done_at is not None:
                        self._early_by.add(t - plan.done_at)
                elif plan.state == "on_device" and partial:
                    cls = "head_only"  # the rest of the chain had no room before the request came
                elif plan.state in ("on_device", "evicted"):
                    cls = "wasted"
                elif plan.state == "prefetching":  # the request is ahead of the upload in flight
                    cls = "late"
                else:  # no upload had started: the request's own (demand) load brings the chain
                    cls = "superseded_by_request"
                self._classify(plan, cls)
                out.append((sid, cls))
        return out

    def on_waiting(self, session_id: str, *, now: float | None = None) -> int:
        """The session's next request arrived and waits for admission; returns how many plans it holds.

        Its stalls' host copies are the next thing the engine will load, however long the queue:
        until the request is admitted (:meth:`on_request`) or given up (:meth:`on_waiting_cancelled`)
        they are not released as unused — under a long queue a fixed grace after the tool's return
        would free exactly the copies that are needed soonest (``docs/policy.md`` §3).
        """
        t = self._now(now)
        n = 0
        with self._lock:
            for plan in self._stalls.values():
                if plan.session_id == session_id and plan.waiting_since is None:
                    plan.waiting_since = t
                    n += 1
        return n

    def on_waiting_cancelled(self, session_id: str, *, now: float | None = None) -> None:
        """The waiting request left without being admitted (aborted): the usual grace applies again."""
        t = self._now(now)
        with self._lock:
            for plan in self._stalls.values():
                if plan.session_id == session_id and plan.waiting_since is not None:
                    plan.waiting_since = None
                    if plan.ended_at is not None:
                        plan.ended_at = max(plan.ended_at, t)

    def expired(self, now: float | None = None) -> list[str]:
        """Stalls to give up on: no end by ``expires_at``, or ended ``unused_after_s`` ago with no request.

        A stall whose session's next request is waiting for admission (:meth:`on_waiting`) is kept
        until ``expiry_max_s`` after the request arrived.

        Returns their ids (release their host pins); they are classified ``expired``, ``wasted``
        (prefetched, never used) or ``unused``.
        """
        t = self._now(now)
        gone: list[str] = []
        with self._lock:
            for sid, plan in list(self._stalls.items()):
                if plan.waiting_since is not None:
                    if t - plan.waiting_since < self.expiry_max_s:
                        continue
                    cls: Classification = "unused"
                elif plan.ended_at is None:
                    if t < plan.expires_at:
                        continue
                    cls = "expired"
                elif t - plan.ended_at >= self.unused_after_s:
                    cls = "wasted" if plan.state in ("on_device", "evicted") else "unused"
                else:
                    continue
                del self._stalls[sid]
                self._classify(plan, cls)
                gone.append(sid)
        return gone

    # ---------------------------------------------------------------- queries
    def get(self, stall_id: str) -> PlannedStall | None:
        """A copy of the plan (open or recently finished), or None."""
        with self._lock:
            plan = self._stalls.get(stall_id) or self._finished.get(stall_id)
            return dataclasses.replace(plan) if plan is not None else None

    def is_open(self, stall_id: str) -> bool:
        """Whether the stall is still planned (not yet classified, expired or cancelled); cheap."""
        with self._lock:
            return stall_id in self._stalls

    def open_stalls(self, session_id: str | None = None) -> list[PlannedStall]:
        with self._lock:
            return [
                dataclasses.replace(p)
                for p in self._stalls.values()
                if session_id is None or p.session_id == session_id
            ]

    def counts(self) -> dict[str, int]:
        """A copy of the cumulative counters (classifications, starts, cancellations); cheap."""
        with self._lock:
            return dict(self._counts)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "open": len(self._stalls),
                **dict(sorted(self._counts.items())),
                "on_time_early_by_s": self._early_by.summary(),
                "late_by_s": self._late_by.summary(),
                "return_ratio": self.returns.ratio(None),
                "return_ratios": _summary(self.returns.overall),
                "return_ratio_samples": len(self.returns.overall),
            }

    # ---------------------------------------------------------------- helpers
    def _classify(self, plan: PlannedStall, cls: Classification) -> None:
        plan.classification = cls
        if plan.state != "prefetching":
            plan.state = "done"
        self._count(cls)
        self._remember(plan)

    def _remember(self, plan: PlannedStall) -> None:
        self._finished[plan.stall_id] = plan
        self._finished.move_to_end(plan.stall_id)
        while len(self._finished) > self._max_finished:
            self._finished.popitem(last=False)

    def _count(self, name: str) -> None:
        self._counts[name] = self._counts.get(name, 0) + 1

    def return_ratio(self, key: str | None = None) -> float:
        """The ratio a stall of ``key`` planned now would aim at (for stats and tests)."""
        with self._lock:
            return self.returns.ratio(key)

    def observe_return(self, key: str | None, begin_at: float, predicted_s: float, ended_at: float) -> None:
        """Learn the return of one tool call of a stall shared by several (``end(learn=False)``)."""
        with self._lock:
            self.returns.learn(key, begin_at, predicted_s, ended_at)

    def _timing_locked(
        self, begin_at: float, predicted_s: float, lead_s: float, key: str | None, mode: str
    ) -> tuple[float, float, float]:
        """``(due_at, late_at, expires_at)`` of a stall of ``key`` (the module docstring's rule)."""
        predicted = _finite(predicted_s)
        expires_at = begin_at + stall_expiry_s(
            predicted, factor=self.expiry_factor, min_s=self.expiry_min_s, max_s=self.expiry_max_s
        )
        if mode != "predictive":
            return math.inf, math.inf, expires_at
        due_at = begin_at + max(self.returns.ratio(key) * predicted - lead_s, 0.0)
        return due_at, begin_at + self.returns.ratio(key, late=True) * predicted, expires_at


class ReturnRatios:
    """Learned return-time ratios (actual / predicted duration of ended stalls), overall and per
    key (``agent_type/tool``, a bounded LRU of keys), and the quantile a plan aims at (see the
    module docstring). Not thread-safe: the planner calls it under its lock."""

    def __init__(
        self, quantile: float | None, prior: float, min_samples: int, window: int, max_keys: int
    ) -> None:
        self.return_quantile, self.prior_ratio, self.min_samples = quantile, prior, min_samples
        self._window, self._max_keys = window, max_keys
        self.overall: deque[float] = deque(maxlen=window)
        self._by_key: OrderedDict[str, deque[float]] = OrderedDict()

    def ratio(self, key: str | None, *, late: bool = False) -> float:
        """``r_q``: the return-time ratio the upload aims at (see the module docstring); ``late``:
        its mirror ``r_(1-q)``, the late end of the likely return (``1 / prior_ratio`` before
        any history)."""
        if self.return_quantile is None:
            return 1.0
        q = 1.0 - self.return_quantile if late else self.return_quantile
        for ratios in (self._by_key.get(key) if key is not None else None, self.overall):
            if ratios is not None and len(ratios) >= self.min_samples:
                return quantile(sorted(ratios), q)
        prior = self.prior_ratio
        return (1.0 / prior if prior > 0 else 1.0) if late else prior

    def learn(self, key: str | None, begin_at: float, predicted_s: float, ended_at: float) -> None:
        if _finite(predicted_s) <= 0:
            return
        # Bounded: one runaway tool must not move the quantile to infinity.
        ratio = min(max(ended_at - begin_at, 0.0) / predicted_s, 100.0)
        self.overall.append(ratio)
        if key is None:
            return
        ratios = self._by_key.get(key)
        if ratios is None:
            ratios = self._by_key[key] = deque(maxlen=self._window)
            while len(self._by_key) > self._max_keys:
                self._by_key.popitem(last=False)
        else:
            self._by_key.move_to_end(key)
        ratios.append(ratio)


def _summary(values: deque[float]) -> dict[str, float | int]:
    hist = Histogram(max(len(values), 1))
    for v in values:
        hist.add(v)
    return hist.summary()


def _finite(value: float) -> float:
    """A non-negative finite number or 0 (a bad estimate must not move the due time to ±inf)."""
    return value if math.isfinite(value) and value > 0 else 0.0
