"""``TokenCakeConnector``: the vLLM KV connector that loads TokenCake into stock vLLM.

vLLM builds it twice from ``--kv-transfer-config``
(``"kv_connector_module_path": "tokencake.serving.vllm.connector"``): once with the SCHEDULER
role inside EngineCore (policy, events listener, block-pool bookkeeping — see ``scheduler_side.py``)
and once with the WORKER role in each worker process (the copies — see ``worker.py``). This
class only routes vLLM's hooks to those halves and makes every hook defensive: an exception in
a scheduler-side hook would kill the engine, so each is caught, counted in ``/v1/stats``
(``errors.*``) and answered with what stock vLLM would do (no external tokens, free blocks now,
no copies). ``get_kv_connector_stats`` / ``build_prom_metrics`` export the key counters on vLLM's
own ``/metrics`` as ``vllm:tokencake_*`` (see ``metrics.py``).

``kv_connector_extra_config`` keys: ``events_host`` (default 127.0.0.1), ``events_port`` (no
listener when absent), ``host_pool_blocks`` or ``host_pool_gib`` (default 1 GiB),
``offload`` / ``prefetch`` / ``demand_load`` / ``early_save`` / ``demote`` (default true),
``wake_idle_engine`` (default true), ``policy`` (a name from ``tokencake.serving.policies``;
default ``tokencake``), ``profile_dir`` (where the prefill profile is kept per model and hardware;
default ``~/.cache/tokencake/profiles``; ``off`` keeps it in memory only), and the numeric policy
knobs of :func:`~tokencake.serving.vllm.connector_config.options_from_extra`.

The events API key comes from the environment (``TOKENCAKE_EVENTS_API_KEY``, which ``Server``
sets in the vLLM child only): the extra config is part of vLLM's argv and of its logged
arguments. A legacy ``api_key`` key still works, with a warning.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tokencake.serving.event_api import EventServer
from tokencake.serving.options import extra_bool
from tokencake.serving.profile import PrefillProfile
from tokencake.serving.vllm import _blockpool as bp
from tokencake.serving.vllm import metrics as tc_metrics
from tokencake.serving.vllm.connector_config import (
    check_block_size,
    events_address,
    events_api_key,
    geometry,
    host_pool_blocks,
    lookahead_tokens,
    options_from_extra,
    profile_file,
)
from tokencake.serving.vllm.metadata import CopyJob, TokenCakeMetadata, TokenCakeWorkerMeta
from tokencake.serving.vllm.scheduler_side import SchedulerSide
from tokencake.serving.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.tokencake")


def _timed(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Add the hook's wall time to the connector's per-step total (``engine.hook_seconds``).

    The scheduler-side hooks run on the engine thread between forwards: their time is what the
    extension adds to every step, the number that must stay small where nothing needs moving."""

    @functools.wraps(hook)
    def timed(self: TokenCakeConnector, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self._hook_s += time.perf_counter() - started

    return timed


class TokenCakeConnector(KVConnectorBase_V1):
    """Temporal KV management around agent tool calls (offload, prefetch, demand load)."""

    _cache_hit_source = CacheHitSource.HOST
    #: Scheduler-side hook time since the last step (see ``_timed``); a class default, so an
    #: instance built without ``__init__`` (tests, subclasses) is timed too.
    _hook_s: float = 0.0

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped copy is a future miss, never a correctness issue.
        return False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.sched: SchedulerSide | None = None
        self._hook_s = 0.0  # scheduler-side hook time since the last step (see _timed)
        self.worker: WorkerSide | None = None
        self.disabled: str | None = None
        self._events: EventServer | None = None
        self._waker: threading.Thread | None = None
        self._stop = threading.Event()
        self._prom_delta = tc_metrics.DeltaTracker()
        try:
            if not vllm_config.cache_config.enable_prefix_caching:
                raise ValueError("prefix caching is disabled (TokenCake needs it)")
            block_size, block_bytes, num_device_blocks = geometry(kv_cache_config)
            check_block_size(vllm_config, kv_cache_config)
            num_host = host_pool_blocks(extra, block_bytes)
        except Exception as exc:
            self.disabled = f"{type(exc).__name__}: {exc}"
            log.warning("TokenCake connector passes through (%s)", self.disabled)
            return
        if role == KVConnectorRole.SCHEDULER:
            try:
                self._init_scheduler(vllm_config, extra, block_size, block_bytes, num_host)
            except Exception as exc:  # a bad knob or an unexpected config must not stop the engine
                self._stop.set()
                if self._events is not None:
                    self._events.close()
                    self._events = None
                self.sched = None
                self.disabled = f"{type(exc).__name__}: {exc}"
                log.exception("TokenCake connector passes through (%s)", self.disabled)
        else:
            self.worker = WorkerSide(num_device_blocks, num_host)

    def _init_scheduler(
        self, vllm_config: VllmConfig, extra: dict[str, Any], block_size: int, block_bytes: int, num_host: int
    ) -> None:
        # A failed host load must mean "recompute", never "fail the request". vLLM's default is
        # "fail"; vLLM's Scheduler reads the policy right after building this connector.
        kvt = self._kv_transfer_config
        if getattr(kvt, "kv_load_failure_policy", "recompute") != "recompute":
            try:
                kvt.kv_load_failure_policy = "recompute"
                log.info("TokenCake: kv_load_failure_policy set to 'recompute'")
            except Exception:
                log.warning("TokenCake: could not set kv_load_failure_policy=recompute; pass it")
        opts = options_from_extra(extra)
        cuda = torch.cuda.is_available()
        self.sched = SchedulerSide(
            block_size=block_size,
            block_bytes=block_bytes,
            num_host_blocks=num_host,
            num_workers=vllm_config.parallel_config.world_size,
            max_step_tokens=int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 2048),
            lookahead_tokens=lookahead_tokens(vllm_config),
            watermark=float(getattr(vllm_config.scheduler_config, "watermark", 0.0) or 0.0),
            full_sequence_must_fit=bool(
                getattr(vllm_config.scheduler_config, "scheduler_reserve_full_isl", True)
            ),
            device_is_cuda=cuda,
            options=opts,
            profile=PrefillProfile(device_is_cuda=cuda, path=profile_file(vllm_config, extra, cuda)),
        )
        if extra_bool(extra, "wake_idle_engine", True):
            wake = bp.find_engine_wakeup()
            self.sched.set_wake(wake)
            self.sched.stats.set("engine.wake_available", 1 if wake else 0)
            if wake is not None:
                self._waker = threading.Thread(target=self._wake_loop, name="tokencake-waker", daemon=True)
                self._waker.start()
        self._start_events(extra)
        log.info(
            "TokenCake scheduler side: block %d tokens, %d bytes/block, host pool %d blocks (%.2f GiB)",
            block_size,
            block_bytes,
            num_host,
            num_host * block_bytes / 2**30,
        )

    # ------------------------------------------------------------ helpers
    def _start_events(self, extra: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> None:
        """Start the events listener; any failure is logged and counted, never raised."""
        if self.sched is None:
            return
        try:
            address = events_address(extra)
            if address is None:
                return
            self._events = EventServer(
                *address,
                self.sched.handle_event,
                stats_fn=self.sched.stats_snapshot,
                api_key=events_api_key(extra, environ),
            ).start()
            log.info("TokenCake events listener on %s", self._events.url)
        except Exception as exc:  # a busy or bad port must not take the engine down
            log.error(
                "TokenCake events listener not started (%s:%s): %s",
                extra.get("events_host"),
                extra.get("events_port"),
                exc,
            )
            self._events = None
            self.sched.stats.set("events.listener_up", 0)
            return
        self.sched.stats.set("events.listener_up", 1)

    def _wake_loop(self) -> None:
        """Wake an idle engine when a timed prefetch falls due (events wake it directly)."""
        woken_for: float | None = None
        while not self._stop.wait(0.05):
            sched = self.sched
            if sched is None:
                return
            due = sched.next_wake_at()
            if due is not None and due != woken_for and time.monotonic() >= due:
                woken_for = due
                sched._poke()

    def _count_error(self, hook: str) -> None:
        log.exception("TokenCake: %s failed; falling back to stock behaviour", hook)
        if self.sched is not None:
            self.sched.stats.inc(f"errors.{hook}")

    def _follow_pool_reset(self) -> None:
        """First in every hook that serves, plans, commits or decides on a copy (stall decisions
        drain in ``on_new_request`` / ``admit`` too): a device-only prefix-cache reset resets the
        host side too (``SchedulerSide.follow_pool_reset``)."""
        self._ask("follow_pool_reset", lambda s: s.follow_pool_reset(), False)

    def _ask(self, hook: str, call: Callable[[SchedulerSide], Any], failed: Any) -> Any:
        """``call`` on the scheduler side; an exception is logged and counted (``errors.<hook>``)
        and answers ``failed``: it never reaches vLLM's scheduler loop."""
        assert self.sched is not None
        try:
            return call(self.sched)
        except Exception:
            self._count_error(hook)
            return failed

    # ============================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker is not None:
            self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, TokenCakeMetadata) and meta.jobs:
            self.worker.start_jobs(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # demand loads are complete (CPU) or stream-ordered (CUDA) before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # offloads copy whole cached blocks at stall begin, not per layer during a forward

    def wait_for_save(self) -> None:
        # After the forward: offloads may read blocks hashed this step only now (see worker.py).
        if self.worker is not None:
            self.worker.start_saves()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> TokenCakeWorkerMeta | None:
        return self.worker.take_results() if self.worker is not None else None

    def shutdown(self) -> None:
        self._stop.set()
        if self.worker is not None:
            self.worker.shutdown()
        if self._events is not None:
            self._events.close()
        if self.sched is not None:
            self.sched.shutdown()

    # ========================================================= scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        if self.sched is not None:
            self.sched.bind_pool(gpu_block_pool)

    @_timed
    def on_new_request(self, request: Request) -> None:
        if self.sched is None:
            return
        self._follow_pool_reset()
        self._ask("on_new_request", lambda s: s.on_new_request(request), None)

    def enable_admission_control(self, running_need: Callable[[], int] | None = None) -> bool:
        """TokenCake's scheduler applies :meth:`admit` to every waiting request vLLM looks at (see
        ``SchedulerSide.admit``); False: there is no scheduler side to ask (passing through)."""
        if self.sched is None:
            return False
        self.sched.enable_admission_control(running_need)
        return True

    @_timed
    def admit(self, request: Request, num_running: int) -> bool:
        """Called by TokenCake's scheduler for each waiting request vLLM's admission loop looks at:
        False = skip it this pass (vLLM looks at the next one). A failure answers True, vLLM's
        own admission."""
        if self.sched is None:
            return True
        self._follow_pool_reset()
        return bool(self._ask("admit", lambda s: s.admit(request, num_running), True))

    @_timed
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.sched is None:
            return 0, False
        self._follow_pool_reset()
        try:
            # None: a prefetch of this session is being copied; vLLM asks again next step.
            return self.sched.get_num_new_matched_tokens(request, num_computed_tokens), False
        except Exception:
            self._count_error("get_num_new_matched_tokens")
            return 0, False

    @_timed
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        if self.sched is None:
            return
        block_ids: list[int] = []
        try:
            block_ids = list(blocks.get_block_ids()[0]) if num_external_tokens else []
            self.sched.update_state_after_alloc(request, block_ids, num_external_tokens)
        except Exception:
            self._count_error("update_state_after_alloc")
            if num_external_tokens > 0:
                # vLLM now believes these tokens will be loaded: make the worker report the blocks as
                # failed so vLLM recomputes them instead of reading garbage.
                try:
                    self.sched.fail_load(request, block_ids, num_external_tokens)
                except Exception:
                    self._count_error("fail_load")

    @_timed
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.sched is None:
            return TokenCakeMetadata()
        if self._hook_s > 0:  # the previous step's hooks (this call's own time goes to the next)
            self.sched.stats.inc("engine.hook_seconds", self._hook_s)
            self.sched.stats.observe("engine.hook_ms_per_step", self._hook_s * 1000.0)
            self._hook_s = 0.0
        self._follow_pool_reset()
        try:
            self.sched.observe_step(
                getattr(scheduler_output, "total_num_scheduled_tokens", 0),
                num_running=len(getattr(scheduler_output, "num_scheduled_tokens", None) or ()),
                preempted=self._preempted(scheduler_output),
            )
            return self.sched.build_meta()
        except Exception:
            self._count_error("build_connector_meta")
            return TokenCakeMetadata(self.sched.flush(), release_after_report=True)

    @staticmethod
    def _preempted(scheduler_output: SchedulerOutput) -> set[str]:
        """Requests vLLM preempted this step (back in its waiting queue, no connector call)."""
        return getattr(scheduler_output, "preempted_req_ids", None) or set()

    @_timed
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The step's reports, merged over the ranks by vLLM (``SchedulerSide.on_worker_meta``)."""
        if self.sched is None:
            return
        self._follow_pool_reset()
        try:
            meta = connector_output.kv_connector_worker_meta
            invalid = getattr(connector_output, "invalid_block_ids", None) or ()
            self.sched.on_worker_meta(meta if isinstance(meta, TokenCakeWorkerMeta) else None, invalid)
        except Exception:
            self._count_error("update_connector_output")

    @_timed
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.sched is None:
            return False, None
        self._follow_pool_reset()
        try:
            provenance = self.sched.request_finished(request)
        except Exception:
            self._count_error("request_finished")
            return False, None
        # Returned with the response (vLLM's kv_transfer_params): where this request's KV came from.
        return False, ({"tokencake_kv": provenance} if provenance is not None else None)

    def release_device_holds(self) -> int:
        """Called by TokenCake's scheduler right before vLLM resets its prefix cache (which refuses
        while blocks are in use): the chains the policy holds on device are given back."""
        if self.sched is None:
            return 0
        return self._ask("release_device_holds", lambda s: s.release_device_holds(), 0)

    def device_copies_in_flight(self) -> int:
        """Copies in flight that pin device blocks (a prefix-cache reset must wait for them)."""
        if self.sched is None:
            return 0
        return self._ask("device_copies_in_flight", lambda s: s.device_copies_in_flight(), 0)

    def reset_cache(self) -> bool | None:
        """vLLM reset its prefix cache (e.g. new weights): host copies are stale, drop them all.
        Called with ``reset_connector=True`` only; else ``_follow_pool_reset`` sees the reset."""
        if self.sched is None:
            return None
        return self._ask("reset_cache", lambda s: s.reset_cache(), False)

    @_timed
    def has_pending_block_frees(self) -> bool:
        """vLLM asks this right before it would preempt a running request that found no free
        block: the chains TokenCake holds on device are given back instead (``free_for_running``)."""
        if self.sched is None:
            return False
        self._follow_pool_reset()
        return self._ask("has_pending_block_frees", lambda s: s.free_for_running(), False)

    @_timed
    def has_pending_push_work(self) -> bool:
        if self.sched is None:
            return False
        return self._ask("has_pending_push_work", lambda s: s.has_pending_work(), False)

    def take_events(self) -> Iterable[Any]:
        return ()

    # ------------------------------------------------- Prometheus (/metrics)
    @_timed
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Scheduler side, every step: the exported counters' increase since the last call.

        vLLM sends it to the API server process, where :meth:`build_prom_metrics`' object adds it
        to the ``vllm:tokencake_*`` counters (``metrics.py``). The worker side has none.
        """
        if self.sched is None:
            return None
        try:
            totals = tc_metrics.connector_totals(
                self.sched.stats.counters_with_prefix(""), self.sched.planner.counts()
            )
            delta = self._prom_delta.delta(totals)
            return tc_metrics.TokenCakeKVConnectorStats(delta) if delta else None
        except Exception:
            self._count_error("get_kv_connector_stats")
            return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return tc_metrics.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return tc_metrics.build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None


__all__ = ["CopyJob", "TokenCakeConnector", "events_address", "events_api_key", "host_pool_blocks"]
