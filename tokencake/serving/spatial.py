"""Who is admitted first when more requests wait than device KV can take: the spatial score.

The temporal half (forecast → gate → offload / prefetch) decides where an idle session's KV lives.
This decides the order in which waiting requests get device memory. vLLM's priority scheduler
orders by a fixed integer the client sends (``priority``, from the SDK's critical path) and then by
arrival, so a request of a non-critical agent that has waited a minute still loses to every new
critical one, and a plain OpenAI request (priority 0) ranks with the critical path. The score below
combines the DAG position the SDK sends with what happened since the request arrived, and it ages,
so the order is work-conserving and nothing starves. A critical-path request keeps the head start
the priority scheduler gives it (``critical_s``), but only a bounded one.

A score is in seconds of slack; lower is admitted first::

    base  = plain_slack_s                                   a plain request (no TokenCake metadata)
          = min(left / importance, max_slack_s)             an agent request; left = 0 on the
            − critical_s if the node is on the critical path             critical path, else the
              or its branch has spent its slack                          node's slack − behind
            + per_remaining_depth_s × min(remaining_depth, max_depth)    (fewer nodes left: earlier)

    behind = lag_spends_slack × max(0, the session's queue waits so far
                                       − the most any critical-path session of its app waited)
    score = base − app_age × (now − app start) − aging × waited
            − per_preemption_s × min(preemptions, max_preemptions)
            − retained_s if the session's KV is held on device for it (a keep or a prefetched chain),
              else saved_s if its last chain is saved on host (it resumes with a load)

The app start is the arrival of the first of its requests the scorer saw, but never more than
``max_app_age_s`` before the request arrived (an app is "old" by at most that much); a plain
request is a one-request app that started when it arrived. Every request's score falls at the
same rate (``app_age + aging`` per second), so the order never changes while requests wait: the
queue keeps them in a heap by :meth:`SpatialScorer.order_key` (the score plus that drift), computed
once when a request is queued.

Ties go to the earlier arrival, then the request id. Plain requests all have the same base, so
among themselves they stay first come, first served; requests of one app too. Every term but the
ages is bounded, and the app's head start over its request's arrival is at most ``max_app_age_s``,
so a request that has waited ``(max_base − min_base + app_age × max_app_age_s) / (aging + app_age)``
seconds longer than a newcomer ranks ahead of it: :meth:`SpatialScorer.max_overtake_s` is that bound
(the starvation guarantee: 808 s with the defaults).

The weights, and why (``docs/policy.md`` §7 has the measurements). Every term is in seconds of
the app's time: with ``app_age`` 1 an agent request ranks by when its app started plus the slack its
node has, so the order is, in turn,

* **the critical path first** (``critical_s`` 400 s: more than the largest app-age credit, 300 s,
  plus the other credits a request can hold and the depth a critical one can be charged, 16 s in
  all, so an older app's non-critical request never
  outranks a younger app's critical path — first come first served by app *across* classes lost
  to vLLM's priority order in the simulator: the critical path waited 1.2 × longer, mean app E2E
  1.06 ×, up to 1.41 ×);
* **then the app that started first** (``app_age`` 1 s per second, the start taken at most 300 s
  before the request's arrival). The mean app E2E rewards finishing apps one after another when
  the device holds only a few sessions; a fan-in app finishes with its slowest worker, so every
  request of the older app, a fresh one (a join, a worker's first turn) as much as a returning one,
  goes before the younger app's;
* **then the credits, as tie-breakers among apps that started about together**: 1 s each for KV
  held on device for the session (``retained_s``: admitting it uses those blocks before they have
  to yield, and it needs the fewest new ones) or else its last chain saved on host (``saved_s``: it
  resumes with a load instead of a prefill, and its pinned host copies go back to the pool sooner;
  without it, on a host pool smaller than the working set such requests waited while new saves
  found the pool full in the simulator) and per preemption (``per_preemption_s``,
  at most 5); and 0.5 s of slack per node of DAG depth still behind the request (at most 20),
  so of two apps that started together the one with fewer nodes left goes first — shortest
  remaining first, what a mean over apps rewards. With the depth left as a credit instead
  (admission order ``remaining-depth-first``), on a contended mix of two apps that arrive together
  every critical request of the 20-node Code-Writer went before the 5-node Deep-Research's, which
  then ended slower than with vLLM's priority order (``CHANGELOG.md``). Within one app the critical
  path already goes first, and the depth left only orders branches that have slack;
* **the critical path is the one the app is on now, not only the one planned**: the SDK's slack
  says how far a branch may fall behind the critical path before it delays the app; every second
  its session queued here beyond what the app's critical-path sessions queued spends a second of
  it (``lag_spends_slack``), and a branch that has spent it all ranks as critical from its next
  request on. (Queueing alike spends nothing: the whole app is late then, not the branch.) With
  the slack fixed (admission order ``static-slack``), an app's "non-critical" worker that kept
  losing the queue to younger apps' critical requests became its slowest (the simulator's mixes
  favour the dynamic rule in geometric mean; ``CHANGELOG.md``);
* **then arrival** (``aging`` 0.01 s per second of waiting): slow, because it only has to bound
  starvation (every faster aging lost to vLLM's priority order in the simulator: 0.25 s/s, 1.04 ×
  geometric mean, up to 1.30 ×).

Why the app's age weighs a full second per second: with 0.1 s per second against 10 s credits for
held or saved chains (admission order ``apps-side-by-side``, bench system of the same name), apps
that started a few seconds apart are served side by side, and a fresh request — the oldest app's
join, a worker's first turn — waits behind every younger app's returning one; on a fan-in draw with
a device that holds three or four sessions one app's first turns waited 43 s and every app
finished late.

The KV policy chooses the weights (:func:`admission_weights` of its ``admission``, unless the
deployment names one: connector option ``admission``): TokenCake's policy the score above;
Continuum's the order its paper schedules by, first come first served except that a request whose
program's KV is retained on device goes first (``CONTINUUM``: every term zero
but ``retained_s``, so a retained session overtakes for at most ``retained_s`` of waiting).

Pure Python (no vLLM): ``tokencake/serving/vllm/scheduler.py`` applies it inside vLLM's scheduler.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokencake.events import RequestMeta

__all__ = [
    "ADMISSIONS",
    "CRITICAL_WATCH",
    "SpatialScorer",
    "SpatialWeights",
    "admission_weights",
    "demote_rank",
    "reserved_sessions",
]

#: Critical-path sessions whose idle chains are watched (most recent): for critical inversions,
#: and kept out of a non-critical admission's eviction window while not safe on host.
CRITICAL_WATCH = 64


@dataclass(frozen=True)
class SpatialWeights:
    """The score's constants (see the module docstring); every term is bounded."""

    #: A plain request (no TokenCake metadata) ranks as if it had this much slack.
    plain_slack_s: float = 5.0
    #: Slack beyond this is "not urgent" alike.
    max_slack_s: float = 100.0
    #: A critical-path request's head start: more than the largest app-age credit plus every other
    #: credit, so the critical path goes first across apps, yet it is bounded.
    critical_s: float = 400.0
    #: Seconds of slack one second of waiting cancels: slow, it only bounds starvation (faster aging
    #: let waiting non-critical requests overtake the critical path).
    aging: float = 0.01
    #: Each node still to run after this one (the DAG's remaining depth) counts as this much more
    #: slack (``fewer_left_first``) or less (the order before: more of the DAG left, earlier).
    per_remaining_depth_s: float = 0.5
    fewer_left_first: bool = True
    max_depth: int = 20
    #: Of the app's elapsed time (since its first request here), this share counts as slack spent,
    #: the app's start taken at most ``max_app_age_s`` before the request's arrival: within a class
    #: the app that started first goes first; at most 300 s, below ``critical_s``.
    app_age: float = 1.0
    max_app_age_s: float = 300.0
    #: Each time vLLM preempted the request (it lost its KV and work) it moves ahead this much.
    per_preemption_s: float = 1.0
    max_preemptions: int = 5
    #: The session's KV is held on device for it (a keep, or a prefetched chain): admitting it
    #: first uses those blocks before they have to yield, and it needs the fewest new ones.
    retained_s: float = 1.0
    #: Seconds of slack one second of a branch's extra queueing spends: a node's slack is what it
    #: may fall behind the critical path, so when its session has waited in this queue longer than
    #: the app's critical-path sessions did, the difference comes off its slack — and a branch that
    #: has spent it all is on the critical path now (the static path was only the plan). 0: the
    #: slack the SDK sent, fixed (admission order ``static-slack``).
    lag_spends_slack: float = 1.0
    #: Else its last chain is saved on host (at least half of it, from the head): it resumes with a
    #: load instead of a prefill, and — where its stall's plan pins them (an offloaded stall) — its
    #: copies stay pinned while it waits, so admitting it first gives those host slots back to other
    #: sessions' saves. The credit is fixed when the request is queued. Without it, on a host pool
    #: smaller than the working set the order by slack alone let such requests wait while new saves
    #: found the pool full (in the simulator). A tie-breaker: below the
    #: age gap of apps that started a second or more apart.
    saved_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.aging > 0:
            raise ValueError("aging must be > 0 (it is what keeps requests from starving)")
        for name in (
            "plain_slack_s",
            "max_slack_s",
            "critical_s",
            "per_remaining_depth_s",
            "app_age",
            "per_preemption_s",
            "retained_s",
            "saved_s",
            "lag_spends_slack",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


#: Admission orders a KV policy can ask for (``KVPolicy.admission``).
ADMISSIONS: dict[str, SpatialWeights] = {
    "spatial": SpatialWeights(),
    # An ablation: the app's age 0.1 s per second against 10 s credits, so apps that started
    # seconds apart are served side by side.
    "apps-side-by-side": SpatialWeights(
        critical_s=40.0,
        aging=0.05,
        app_age=0.1,
        per_preemption_s=2.0,
        retained_s=10.0,
        saved_s=10.0,
        lag_spends_slack=0.0,
    ),
    # The spatial score with the SDK's slack fixed: a branch that fell behind stays non-critical.
    "static-slack": SpatialWeights(lag_spends_slack=0.0),
    # The spatial score with the DAG depth left as a credit (an ablation): of apps that started
    # together, the one with more nodes left goes first.
    "remaining-depth-first": SpatialWeights(fewer_left_first=False),
    # Continuum: FCFS, but a program whose KV is retained (a TTL pin) is scheduled first.
    "continuum": SpatialWeights(
        aging=1.0,
        plain_slack_s=0.0,
        max_slack_s=0.0,
        critical_s=0.0,
        per_remaining_depth_s=0.0,
        app_age=0.0,
        per_preemption_s=0.0,
        retained_s=30.0,
        saved_s=0.0,
        lag_spends_slack=0.0,
    ),
}


def admission_weights(name: str | None) -> SpatialWeights:
    """The weights of admission order ``name`` (unknown or None: the spatial score's)."""
    return ADMISSIONS.get(name or "spatial", ADMISSIONS["spatial"])


def reserved_sessions(critical_holds: Iterable[tuple[str, float, int]], cap_blocks: int) -> frozenset[str]:
    """The critical reserve: of the critical-path sessions' holds ``(session, returns at,
    releasable blocks)``, those returning soonest while their blocks fit in ``cap_blocks``."""
    out: list[str] = []
    used = 0
    for session_id, _returns_at, n in sorted(critical_holds, key=lambda h: h[1]):
        if used + n > cap_blocks:
            break
        used += n
        out.append(session_id)
    return frozenset(out)


def demote_rank(*, critical: bool, returns_at: float) -> tuple[int, float]:
    """Where an idle, host-safe chain goes in the eviction queue: the highest rank is evicted first.

    Non-critical sessions before critical-path ones (losing a critical chain delays the whole app,
    and an eviction of it by a non-critical admission is a critical inversion), then the session
    that returns last first (KVFlow's steps-to-execution order, with time instead of steps).
    """
    return (0 if critical else 1, returns_at)


@dataclass
class SpatialScorer:
    """Scores requests (lower first) and remembers when each app was first seen (bounded)."""

    weights: SpatialWeights = field(default_factory=SpatialWeights)
    max_apps: int = 4096
    _app_start: OrderedDict[str, float] = field(default_factory=OrderedDict, init=False, repr=False)
    #: Per session: [its last request's id, that request's queue wait, the waits before it].
    _lag: OrderedDict[str, list] = field(default_factory=OrderedDict, init=False, repr=False)
    #: Per app: the most a critical-path session of it has waited in this queue, in all.
    _critical_lag: OrderedDict[str, float] = field(default_factory=OrderedDict, init=False, repr=False)

    def base(self, meta: RequestMeta | None) -> float:
        """The part of the score fixed by the request itself (DAG position, importance)."""
        w = self.weights
        if meta is None:
            return w.plain_slack_s
        graph = meta.graph
        spent = w.lag_spends_slack * self.behind_s(meta)
        left = max(graph.slack_s, 0.0) - spent
        if graph.on_critical_path or (spent > 0.0 and left <= 0.0):
            slack = -w.critical_s
        else:
            slack = min(left / max(meta.importance, 1e-3), w.max_slack_s)
        depth = w.per_remaining_depth_s * min(max(graph.remaining_depth, 0), w.max_depth)
        return slack + depth if w.fewer_left_first else slack - depth

    def lag_s(self, session_id: str) -> float:
        """Seconds the session's requests have waited in this queue, in all (those it saw leave)."""
        lag = self._lag.get(session_id)
        return 0.0 if lag is None else lag[1] + lag[2]

    def behind_s(self, meta: RequestMeta) -> float:
        """How much longer the session has queued than its app's critical path (0 for a plain or
        critical request): the slack its branch has spent."""
        if not meta.run_id or meta.graph.on_critical_path:
            return 0.0
        return max(self.lag_s(meta.session_id) - self._critical_lag.get(meta.run_id, 0.0), 0.0)

    def admitted(self, meta: RequestMeta | None, *, request_id: str, waited_s: float) -> None:
        """A request left the queue after ``waited_s``: count it in its session's lag.

        The same request may leave more than once (vLLM puts back one it skipped this step): the
        last wait counts, once. LRU-bounded like the app starts.
        """
        if meta is None or not meta.run_id:
            return
        sid = meta.session_id
        lag = self._lag.get(sid)
        if lag is None:
            lag = self._lag[sid] = [request_id, 0.0, 0.0]
            while len(self._lag) > self.max_apps * 8:
                self._lag.popitem(last=False)
        elif lag[0] != request_id:
            lag[0], lag[2] = request_id, lag[1] + lag[2]
        lag[1] = max(waited_s, 0.0)
        self._lag.move_to_end(sid)
        if meta.graph.on_critical_path:
            run = meta.run_id
            self._critical_lag[run] = max(self._critical_lag.get(run, 0.0), self.lag_s(sid))
            self._critical_lag.move_to_end(run)
            while len(self._critical_lag) > self.max_apps:
                self._critical_lag.popitem(last=False)

    def app_start(self, meta: RequestMeta | None, *, arrival: float, now: float) -> float:
        """When the request's app counts as started: its first request's arrival, at most ``max_app_age_s``
        before the request arrived (a plain request is a one-request app: its arrival, and so is
        a request without a ``run_id``: unrelated apps must not pool into one "oldest app")."""
        if meta is None or not meta.run_id:
            return arrival
        # An unknown arrival (0) must not date the app back to the epoch: then it started now.
        started = self.app_started(meta.run_id, min(arrival, now) if arrival > 0 else now)
        return min(max(started, arrival - self.weights.max_app_age_s), arrival)

    def score(
        self,
        meta: RequestMeta | None,
        *,
        waited_s: float,
        preemptions: int,
        now: float,
        retained: bool = False,
        saved: bool = False,
    ) -> float:
        """The score at ``now`` of a request that has waited ``waited_s`` (see the module)."""
        w = self.weights
        key = self.order_key(
            meta,
            arrival=now - max(waited_s, 0.0),
            preemptions=preemptions,
            now=now,
            retained=retained,
            saved=saved,
        )
        return key - (w.aging + w.app_age) * now

    def app_started(self, run_id: str, now: float) -> float:
        """When app ``run_id`` started: the earliest ``now`` (its first request's arrival) it was
        scored with here (LRU-bounded to ``max_apps``)."""
        started = self._app_start.get(run_id)
        if started is None or now < started:
            started = self._app_start[run_id] = now
            while len(self._app_start) > self.max_apps:
                self._app_start.popitem(last=False)
        self._app_start.move_to_end(run_id)
        return started

    def max_overtake_s(self) -> float:
        """How long a waiting request can be overtaken by newcomers, at most (seconds of waiting)."""
        w = self.weights
        depth = w.per_remaining_depth_s * w.max_depth
        highest = max(w.plain_slack_s, w.max_slack_s + (depth if w.fewer_left_first else 0.0))
        lowest = -(
            w.critical_s
            + (0.0 if w.fewer_left_first else depth)
            + w.per_preemption_s * w.max_preemptions  # a preempted request re-enters the queue
            + max(w.retained_s, w.saved_s)
        )
        return (highest - lowest + w.app_age * w.max_app_age_s) / (w.aging + w.app_age)

    def order_key(
        self,
        meta: RequestMeta | None,
        *,
        arrival: float,
        preemptions: int,
        now: float,
        retained: bool = False,
        saved: bool = False,
    ) -> float:
        """A key that sorts requests as their scores do at any later time.

        ``score(t) = key − (aging + app_age) × t`` for every request, so a queue can keep requests
        in a heap by this key and still age them. (The app start enters as an absolute time: a
        key that took the app's age when the request was queued would rank a later request of the
        same app ahead of an earlier one — last come, first served within an app.)
        """
        w = self.weights
        bonus = w.per_preemption_s * min(max(preemptions, 0), w.max_preemptions)
        bonus += w.retained_s if retained else w.saved_s if saved else 0.0
        start = self.app_start(meta, arrival=arrival, now=now)
        return self.base(meta) + w.app_age * start + w.aging * arrival - bonus
