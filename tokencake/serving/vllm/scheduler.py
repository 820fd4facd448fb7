"""``--scheduler-cls``: vLLM's own scheduler, admitting waiting requests in spatial-score order
under TokenCake's admission control.

vLLM admits from ``Scheduler.waiting``; under ``--scheduling-policy priority`` (what every
TokenCake server runs) that is a heap by the client's integer ``priority``, then arrival. The
:class:`SpatialScheduler` swaps it, once at start-up, for a :class:`ScoredRequestQueue` ordered by
the score of ``tokencake/serving/spatial.py``: the DAG position the SDK sends, the app's age, the
preemptions a request suffered and, through the arrival time, how long it has waited.

Admission control (``tokencake/serving/admission.py``): for every waiting request vLLM's admission
loop looks at, the scheduler asks the connector (``SchedulerSide.admit``) before vLLM's own test
whether it goes on — the held chains it needs the blocks of released — or waits this pass, which
vLLM applies as it does for any request not ready yet (``_handle_blocked_waiting_request``: skip
it, look at the next one), never as a failed allocation, which stops admission for everyone
behind. Every wait is bounded, so the score's starvation bound
(:meth:`~tokencake.serving.spatial.SpatialScorer.max_overtake_s`) holds up to that wait. When held
chains yield to a running request (``has_pending_block_frees``), the scheduler tells the connector
how many blocks the running requests still need this step. Nothing else of vLLM changes:
preemption still picks its victim by ``priority``, running requests are never denied blocks.

This relies on internals of vLLM 0.32: the ``waiting`` attribute and the ``RequestQueue``
interface (``add/pop/peek/prepend/remove``), ``_handle_blocked_waiting_request`` (called for every
request the admission loop peeks) and the attributes :meth:`_AdmissionControl._running_need`
reads. :func:`check` verifies them on the versions :data:`SUPPORTED` lists; anywhere else the
scheduler logs why and stays vLLM's own (queue and admission).
``tests/serving/vllm/test_spatial_scheduler.py`` fails when they change.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from tokencake.events import RequestMeta
from tokencake.serving.spatial import SpatialScorer, admission_weights
from tokencake.serving.vllm.scheduler_side import request_meta

log = logging.getLogger("vllm.tokencake.scheduler")  # under "vllm": vLLM formats and shows it

#: vLLM version prefixes whose scheduler internals were checked against this module.
SUPPORTED: tuple[str, ...] = ("0.32.",)
_QUEUE_METHODS = (
    "add_request",
    "pop_request",
    "peek_request",
    "prepend_request",
    "prepend_requests",
    "remove_request",
    "remove_requests",
)

#: The per-request "proceed or skip this step" hook of vLLM's admission loop.
_ADMISSION_HOOK = "_handle_blocked_waiting_request"
#: What ``_running_need`` reads of the scheduler (set in ``Scheduler.__init__``).
_SCHEDULER_FIELDS = (
    "running",
    "kv_cache_manager",
    "max_num_scheduled_tokens",
    "num_lookahead_tokens",
    "max_model_len",
    "block_size",
)

__all__ = ["SUPPORTED", "ScoredRequestQueue", "SpatialScheduler", "check", "scheduler_base"]


def check(scheduler: Any = None) -> str | None:
    """None when the waiting queue can be swapped and admission control applied; else a
    one-line reason why not."""
    version = getattr(vllm, "__version__", "?")
    if not version.startswith(SUPPORTED):
        return f"vllm {version} not in supported versions {SUPPORTED}"
    missing = [m for m in _QUEUE_METHODS if not callable(getattr(RequestQueue, m, None))]
    if missing:
        return f"vLLM's RequestQueue lost {', '.join(missing)}"
    if not callable(getattr(Scheduler, _ADMISSION_HOOK, None)):
        return f"vLLM's Scheduler lost {_ADMISSION_HOOK}"
    if scheduler is None:
        return None
    if not isinstance(getattr(scheduler, "waiting", None), RequestQueue):
        return "Scheduler.waiting is not a RequestQueue"
    lost = [f for f in _SCHEDULER_FIELDS if not hasattr(scheduler, f)]
    if lost:
        return f"vLLM's Scheduler lost {', '.join(lost)}"
    if not callable(getattr(scheduler.kv_cache_manager, "get_block_ids", None)):
        return "vLLM's KVCacheManager lost get_block_ids"
    return None


class ScoredRequestQueue(RequestQueue):
    """Waiting requests by spatial score (lowest first), then arrival, then request id.

    The key is fixed when a request is queued (:meth:`SpatialScorer.order_key`): aging is in it
    through the arrival time, so a heap keeps the order every later score would give. A request
    put back (``prepend``: preempted, or skipped this step) is keyed again with its preemptions
    and its session's lag. Each pop tells the scorer how long the request waited (its branch's
    lag, :meth:`SpatialScorer.admitted`).
    """

    def __init__(
        self,
        scorer: SpatialScorer | None = None,
        clock: Callable[[], float] = time.time,
        retained: Callable[[str], bool] | None = None,
        saved: Callable[[str], bool] | None = None,
    ) -> None:
        self.scorer = scorer or SpatialScorer()
        self.clock = clock
        #: Whether a session's KV is held on device for it (the connector's keeps and holds).
        self.retained = retained
        self.saved = saved
        self._credit_failed = False
        self._lag_failed = False
        #: (key, arrival, request id, sequence, its TokenCake metadata, request): the metadata is
        #: parsed once when queued, and read again when the request leaves (its wait's session).
        self._heap: list[tuple[float, float, str, int, RequestMeta | None, Request]] = []
        self._seq = itertools.count()

    def _entry(self, request: Request) -> tuple[float, float, str, int, RequestMeta | None, Request]:
        arrival = float(getattr(request, "arrival_time", 0.0) or 0.0)
        meta = request_meta(request)
        sid = meta.session_id if meta is not None else None
        held = self._credit(self.retained, sid)
        saved = not held and self._credit(self.saved, sid)
        key = self.scorer.order_key(
            meta,
            arrival=arrival,
            preemptions=int(getattr(request, "num_preemptions", 0) or 0),
            now=self.clock(),
            retained=held,
            saved=saved,
        )
        return (key, arrival, str(request.request_id), next(self._seq), meta, request)

    def _credit(self, ask: Callable[[str], bool] | None, session_id: str | None) -> bool:
        """Ask the connector about the session's KV; a failure costs the credit, never the engine."""
        if ask is None or session_id is None:
            return False
        try:
            return bool(ask(session_id))
        except Exception:  # runs inside vLLM's add_request
            if not self._credit_failed:
                self._credit_failed = True
                log.exception("TokenCake spatial scheduler: KV lookup failed; ordering without its credit")
            return False

    def add_request(self, request: Request) -> None:
        """Queue ``request`` by its key. This runs inside vLLM's ``add_request``: a failure to key
        it (its metadata, the scorer) queues it as a plain request — first come, first served —
        and is logged once; it never reaches vLLM, which would fail the request or the engine."""
        try:
            entry = self._entry(request)
        except Exception:
            if not getattr(self, "_key_failed", False):
                self._key_failed = True
                log.exception("TokenCake spatial scheduler: ordering key failed; queued as a plain request")
            arrival = float(getattr(request, "arrival_time", 0.0) or 0.0)
            try:
                key = self.scorer.order_key(None, arrival=arrival, preemptions=0, now=self.clock())
            except Exception:
                key = arrival
            entry = (key, arrival, str(request.request_id), next(self._seq), None, request)
        heapq.heappush(self._heap, entry)

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        *_, meta, request = heapq.heappop(self._heap)
        self._count_wait(request, meta)
        return request

    def _count_wait(self, request: Request, meta: RequestMeta | None) -> None:
        """The request's wait counts in its session's lag (the slack its branch spent). vLLM also
        pops a request it then skips, and queues it again: the scorer counts its last wait only.
        A failure costs the lag, never the engine (this runs inside vLLM's ``schedule``)."""
        arrival = float(getattr(request, "arrival_time", 0.0) or 0.0)
        if arrival <= 0:
            return
        try:
            self.scorer.admitted(meta, request_id=str(request.request_id), waited_s=self.clock() - arrival)
        except Exception:
            if not self._lag_failed:
                self._lag_failed = True
                log.exception(
                    "TokenCake spatial scheduler: counting a queue wait failed; ordering without it"
                )

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek at an empty queue")
        return self._heap[0][-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)  # the order is the score's; "front" has no meaning here

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[-1]) not in gone]
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap))


def _swap_waiting_queue(scheduler: Any) -> None:
    """Replace the scheduler's waiting queue by a :class:`ScoredRequestQueue` (or say why not)."""
    reason = check(scheduler)
    if reason is not None:
        log.warning("TokenCake spatial scheduler off (%s): vLLM's own admission order", reason)
        return
    side = getattr(getattr(scheduler, "connector", None), "sched", None)  # the TokenCake connector's
    holds, saved = getattr(side, "holds_kv", None), getattr(side, "saved_kv", None)
    # The KV policy chooses the order (Continuum's differs from TokenCake's score).
    # (unless the deployment names one: ``admission`` in kv_connector_extra_config).
    admission = getattr(getattr(side, "opts", None), "admission", "") or getattr(
        getattr(side, "policy", None), "admission", None
    )
    queue = ScoredRequestQueue(
        scorer=SpatialScorer(admission_weights(admission)),
        retained=holds if callable(holds) else None,
        saved=saved if callable(saved) else None,
    )
    queue.prepend_requests(list(scheduler.waiting))
    scheduler.waiting = queue
    if side is not None:
        # Eviction order: critical-path sessions' idle chains go last, their held ones a reserve
        # (unless the deployment keeps only the admission order: ``critical_last=false``).
        side.critical_last = bool(getattr(getattr(side, "opts", None), "critical_last", True))
    log.info("TokenCake spatial scheduler on: waiting requests by %s order", admission or "spatial")


class _ReleasesHoldsOnReset:
    """vLLM resets its block pool before it tells the connector, and the pool reset refuses while
    any block is in use — so ``pause(clear_cache=True)``, ``sleep`` and weight-update resets
    would raise while the KV policy holds a chain on device. Give the holds back first, when
    the reset can succeed (running requests are preempted by it, or there are none).

    A copy in flight pins its device blocks until the workers report it; with those pinned,
    vLLM would preempt every running request and then raise (the pool reset cannot succeed).
    Refuse instead — return False, as vLLM does for a reset that cannot happen yet — and leave
    the running requests alone; the caller retries after the copies land (a step or two)."""

    running: list[Request]
    connector: Any

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        in_flight = getattr(self.connector, "device_copies_in_flight", None)
        busy = in_flight() if callable(in_flight) else 0
        if busy:
            log.warning("TokenCake: prefix cache reset refused: %d KV copies in flight; retry", busy)
            return False
        if reset_running_requests or not self.running:
            release = getattr(self.connector, "release_device_holds", None)
            if callable(release):
                release()
        return super().reset_prefix_cache(reset_running_requests, reset_connector)  # type: ignore[misc]


class _AdmissionControl:
    """vLLM's admission loop asks ``_handle_blocked_waiting_request`` about every waiting
    request it peeks: False skips it this pass (vLLM looks at the next one). After vLLM's own
    reasons (a load or grammar not ready), the connector's: ``admit`` (see the module)."""

    running: list[Request]
    kv_cache_manager: Any
    max_num_scheduled_tokens: int
    num_lookahead_tokens: int
    max_model_len: int
    block_size: int
    #: The connector's ``admit`` once admission control is on (``_enable_admission_control``).
    _tokencake_admit: Callable[[Request, int], bool] | None = None

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        if not super()._handle_blocked_waiting_request(request):  # type: ignore[misc]
            return False
        admit = self._tokencake_admit
        return True if admit is None else admit(request, len(self.running))

    def _running_need(self) -> int:
        """Blocks vLLM's running requests still need this step, as its running loop allocates
        them: in its order and token budget, each its next tokens (a decode token, a prefill
        chunk) and lookahead slots, less the blocks it holds. Requests already scheduled this
        pass hold theirs (they count 0); the long-prefill cap is left out (an upper bound)."""
        budget = self.max_num_scheduled_tokens
        need = 0
        for r in self.running:
            if budget <= 0:
                break
            n = min(r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens, budget)
            if n <= 0:
                continue
            slots = min(r.num_computed_tokens + n + self.num_lookahead_tokens, self.max_model_len)
            held = len(self.kv_cache_manager.get_block_ids(r.request_id)[0])
            need += max(0, -(-slots // self.block_size) - held)
            budget -= n
        return need


def _enable_admission_control(scheduler: Any) -> None:
    """Have the scheduler apply the connector's admission rules (or say why not)."""
    reason = check(scheduler)
    enable = getattr(scheduler.connector, "enable_admission_control", None)
    if reason is None and not callable(enable):
        reason = "the KV connector is not TokenCake's"
    if reason is not None:
        log.warning("TokenCake admission control off (%s): vLLM's own admission", reason)
        return
    if enable(scheduler._running_need):
        scheduler._tokencake_admit = scheduler.connector.admit
        log.info("TokenCake admission control on")


class _SyncSpatialScheduler(_ReleasesHoldsOnReset, _AdmissionControl, Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _swap_waiting_queue(self)
        _enable_admission_control(self)


class _AsyncSpatialScheduler(_ReleasesHoldsOnReset, _AdmissionControl, AsyncScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _swap_waiting_queue(self)
        _enable_admission_control(self)


def scheduler_base(vllm_config: Any) -> type[Scheduler]:
    """vLLM's own choice for this config: ``AsyncScheduler`` when async scheduling is on."""
    return _AsyncSpatialScheduler if vllm_config.scheduler_config.async_scheduling else _SyncSpatialScheduler


class SpatialScheduler(Scheduler):
    """What ``--scheduler-cls`` names: vLLM's scheduler for the config (``AsyncScheduler`` under
    async scheduling, as vLLM would pick without ``--scheduler-cls``, else ``Scheduler``) whose
    waiting queue is a :class:`ScoredRequestQueue` and whose admission applies TokenCake's
    admission control (see the module)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        return scheduler_base(config)(*args, **kwargs)
