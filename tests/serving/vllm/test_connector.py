"""The connector's start-up inside EngineCore: the API key path, the events listener, bad knobs.

``TokenCakeConnector.__init__`` runs in vLLM's EngineCore: whatever it is given, it must either
start or pass through, never raise. The config objects are the few attributes ``__init__`` reads.
"""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tokencake.serving import machine
from tokencake.serving.event_api import EVENTS_API_KEY_ENV
from tokencake.serving.model import ResolvedModel
from tokencake.serving.server import Server
from tokencake.serving.vllm import connector as conn_mod
from tokencake.serving.vllm.connector import TokenCakeConnector, events_address, events_api_key
from tokencake.serving.vllm.connector_config import lookahead_tokens, options_from_extra
from tokencake.serving.vllm.scheduler_side import Options

BEGIN = {
    "type": "stall_begin",
    "stall_id": "st-1",
    "session_id": "run:a",
    "run_id": "run",
    "node": "a",
    "tool": "search",
    "predicted_s": 2.0,
    "ts": 1.0,
}


def _vllm_config(extra: dict[str, Any]) -> Any:
    kvt = KVTransferConfig(
        kv_connector="TokenCakeConnector",
        kv_role="kv_both",
        kv_connector_module_path="tokencake.serving.vllm.connector",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    return SimpleNamespace(
        kv_transfer_config=kvt,
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        parallel_config=SimpleNamespace(world_size=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=256),
    )


KV_CACHE_CONFIG = SimpleNamespace(
    kv_cache_groups=[
        SimpleNamespace(
            kv_cache_spec=SimpleNamespace(page_size_bytes=1024, block_size=16), layer_names=["l0"]
        )
    ],
    num_blocks=64,
)


@pytest.fixture
def build(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Build scheduler-side connectors like EngineCore does; shut them all down afterwards."""
    monkeypatch.delenv(EVENTS_API_KEY_ENV, raising=False)
    made: list[TokenCakeConnector] = []

    def make(extra: dict[str, Any]) -> TokenCakeConnector:
        extra = {"host_pool_blocks": 8, "wake_idle_engine": False, **extra}
        conn = TokenCakeConnector(_vllm_config(extra), KVConnectorRole.SCHEDULER, KV_CACHE_CONFIG)
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.shutdown()


# ------------------------------------------------------------------------------ the API key


def test_key_comes_from_the_environment_first() -> None:
    assert events_api_key({}, {EVENTS_API_KEY_ENV: "env-key"}) == "env-key"
    assert events_api_key({"api_key": "legacy"}, {EVENTS_API_KEY_ENV: "env-key"}) == "env-key"
    assert events_api_key({"api_key": "legacy"}, {}) == "legacy"  # old configs keep working
    assert events_api_key({}, {}) is None
    assert events_api_key({"api_key": ""}, {EVENTS_API_KEY_ENV: ""}) is None


def test_server_hands_the_key_to_the_connector_outside_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "cuda_available", lambda: False)
    monkeypatch.setattr(machine, "cpu_has_bf16", lambda cpuinfo=None: True)
    server = Server(port=9100, api_key="sk-roundtrip-42")
    server.resolved = ResolvedModel("/m", "m")
    argv = server.command()
    assert "sk-roundtrip-42" not in " ".join(argv)
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    # What EngineCore sees: the extra config from argv, the key from the environment.
    assert events_api_key(extra, server.child_env()) == "sk-roundtrip-42"


def test_listener_authenticates_with_the_environment_key(build: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EVENTS_API_KEY_ENV, "sek")
    conn = build({"events_host": "127.0.0.1", "events_port": 0})
    assert conn.disabled is None and conn.sched is not None and conn._events is not None
    url = conn._events.url
    r = httpx.post(f"{url}/v1/events", json=BEGIN)
    assert (r.status_code, r.json()["reason"]) == (401, "unauthorized")
    assert httpx.get(f"{url}/v1/stats").status_code == 401
    ok = httpx.post(f"{url}/v1/events", json=BEGIN, headers={"Authorization": "Bearer sek"})
    assert (ok.status_code, ok.json()["status"]) == (200, "recorded")
    assert conn.sched.stats.gauge("events.listener_up") == 1


# ------------------------------------------------------------------- nothing may raise in __init__


@pytest.mark.parametrize("port", ["abc", 70000, -1, 8001.5, True, [1], math.inf, "1e3"])
def test_bad_events_port_leaves_the_engine_running(build: Any, port: object) -> None:
    conn = build({"events_port": port})
    assert conn.sched is not None and conn.disabled is None  # the extension still runs
    assert conn._events is None
    assert conn.sched.stats.gauge("events.listener_up") == 0


def test_busy_events_port_leaves_the_engine_running(build: Any) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        conn = build({"events_port": sock.getsockname()[1]})
    assert conn.sched is not None and conn._events is None


def test_events_address() -> None:
    assert events_address({}) is None
    assert events_address({"events_port": "8001"}) == ("127.0.0.1", 8001)
    assert events_address({"events_port": 8001.0, "events_host": "::1"}) == ("::1", 8001)
    with pytest.raises(ValueError, match="out of range"):
        events_address({"events_port": 65536})


def test_bad_numeric_knobs_keep_their_defaults() -> None:
    default = Options()
    opts = options_from_extra(
        {
            "usage_threshold": "nan",
            "end_grace_s": math.inf,
            "prefetch_margin_s": "1e400",
            "min_waiting": "many",
            "prefetch_reserve_frac": -0.5,
        }
    )
    assert opts.usage_threshold == default.usage_threshold
    assert opts.end_grace_s == default.end_grace_s
    assert opts.prefetch_margin_s == default.prefetch_margin_s
    assert opts.min_waiting == default.min_waiting
    assert opts.prefetch_reserve_frac == default.prefetch_reserve_frac
    assert options_from_extra({"usage_threshold": "0.3"}).usage_threshold == 0.3
    assert (
        Options().hold_prefetched
        and options_from_extra({"hold_prefetched": "false"}).hold_prefetched is False
    )


def test_scheduler_init_failure_passes_through(build: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(**_kwargs: Any) -> Any:
        raise RuntimeError("unexpected config")

    monkeypatch.setattr(conn_mod, "SchedulerSide", broken)
    conn = build({"events_port": 0})
    assert conn.sched is None and conn._events is None
    assert conn.disabled == "RuntimeError: unexpected config"
    # Stock vLLM behaviour from every hook.
    assert conn.get_num_new_matched_tokens(SimpleNamespace(), 0) == (0, False)
    assert conn.request_finished(SimpleNamespace(), []) == (False, None)
    assert not conn.has_pending_push_work()


# ------------------------------------------------------------------------------ policy + profile


def test_policy_is_chosen_by_name_and_an_unknown_one_falls_back() -> None:
    assert options_from_extra({"policy": "Continuum"}).policy == "continuum"
    assert options_from_extra({"policy": "lru-magic"}).policy == Options().policy == "tokencake"
    assert options_from_extra({"keep_after_end_s": "2.5"}).keep_after_end_s == 2.5


def test_the_admission_order_is_chosen_by_name_and_a_bad_one_is_the_policys() -> None:
    assert Options().admission == ""  # the KV policy's own
    assert options_from_extra({"admission": " Apps-Side-By-Side"}).admission == "apps-side-by-side"
    assert options_from_extra({"admission": "lifo"}).admission == ""


def test_the_reserve_clock_is_chosen_by_name_and_a_bad_one_falls_back() -> None:
    assert Options().critical_reserve_wait_from == "head"
    assert (
        options_from_extra({"critical_reserve_wait_from": " Arrival"}).critical_reserve_wait_from == "arrival"
    )
    assert options_from_extra({"critical_reserve_wait_from": "queue"}).critical_reserve_wait_from == "head"


def test_the_connector_runs_the_configured_policy(build: Any, tmp_path: Any) -> None:
    conn = build({"policy": "offload-all", "profile_dir": str(tmp_path)})
    assert conn.sched is not None and conn.sched.policy.name == "offload-all"
    assert conn.sched.stats_snapshot()["config"]["policy"] == "offload-all"
    # The prefill profile lives per model and hardware under profile_dir.
    assert conn.sched.profile.path is not None and conn.sched.profile.path.parent == tmp_path
    off = build({"profile_dir": "off"})
    assert off.sched is not None and off.sched.profile.path is None


def test_scheduler_side_hook_time_is_reported_per_step(build: Any) -> None:
    """What the extension adds to each engine step is measured, not guessed (``engine.hook_*``)."""
    conn = build({"events_port": 0})
    assert conn.sched is not None
    conn.has_pending_push_work()
    conn.request_finished(SimpleNamespace(request_id="x", kv_transfer_params=None), [])
    assert conn._hook_s > 0
    step = SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={})
    conn.build_connector_meta(step)  # reports the hooks since the previous step
    assert conn.sched.stats.histogram("engine.hook_ms_per_step")["count"] == 1
    assert conn.sched.stats.counter("engine.hook_seconds") > 0
    assert 0 < conn._hook_s < 1  # this call's own time, reported at the next step


def test_vllm_asks_for_held_blocks_before_it_preempts_and_a_failure_means_preempt(
    build: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``has_pending_block_frees`` is vLLM's question right before a preemption: the scheduler side
    answers it (``free_for_running``); an exception answers "no" (vLLM preempts, as stock)."""
    conn = build({"events_port": 0})
    assert conn.sched is not None
    assert conn.has_pending_block_frees() is False  # nothing held
    monkeypatch.setattr(conn.sched, "free_for_running", lambda: True)
    assert conn.has_pending_block_frees() is True

    def broken() -> bool:
        raise RuntimeError("boom")

    monkeypatch.setattr(conn.sched, "free_for_running", broken)
    assert conn.has_pending_block_frees() is False
    assert conn.sched.stats.counter("errors.has_pending_block_frees") == 1


def test_admission_room_reads_vllms_lookahead_and_watermark(build: Any) -> None:
    conn = build({"events_port": 0})
    assert conn.sched is not None and conn.sched.lookahead_tokens == 0 and conn.sched.watermark == 0.0

    class Spec:
        @property
        def num_lookahead_tokens(self) -> int:
            raise AttributeError("no speculative config")

    assert lookahead_tokens(SimpleNamespace(num_lookahead_tokens=3)) == 3  # type: ignore[arg-type]
    assert lookahead_tokens(Spec()) == 0  # type: ignore[arg-type]


def test_decode_context_parallelism_over_a_sharded_spec_passes_through() -> None:
    """vLLM's scheduler block then spans ``dcp`` spec blocks: every hash ↔ block mapping would be off."""
    config = _vllm_config({"host_pool_blocks": 8, "wake_idle_engine": False})
    config.parallel_config = SimpleNamespace(world_size=2, decode_context_parallel_size=2)
    spec = SimpleNamespace(page_size_bytes=1024, block_size=16, dcp_sharded=True)
    kv = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0"])], num_blocks=64
    )
    conn = TokenCakeConnector(config, KVConnectorRole.SCHEDULER, kv)
    assert conn.sched is None and conn.disabled is not None and "context parallelism" in conn.disabled
    conn.shutdown()
