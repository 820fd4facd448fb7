"""Injected copy faults end to end: the real scheduler side, the real worker side, CPU tensors.

The engine loop is reduced to the connector calls vLLM makes each step (schedule → bind →
start_load_kv → forward → wait_for_save → report). Faults come from the worker's
``TOKENCAKE_FAULTS`` knob (passed as :class:`Faults`). What must hold: a failed copy takes the
recompute path, a stalled copy takes the timeout path, nothing raises, no block stays pinned,
and a block that reports a successful load holds exactly the KV that was offloaded.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from tokencake.events import StallBegin, StallEnd  # noqa: E402
from tokencake.serving.vllm import _blockpool as bp  # noqa: E402
from tokencake.serving.vllm.metadata import TokenCakeMetadata, TokenCakeWorkerMeta  # noqa: E402
from tokencake.serving.vllm.scheduler_side import Options, SchedulerSide  # noqa: E402
from tokencake.serving.vllm.worker import Faults, WorkerSide  # noqa: E402

BS = 4
NUM_BLOCKS = 16
HOST_BLOCKS = 8


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def chain(tag: str, n: int) -> list[bytes]:
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{tag}{i}".encode()).digest()
        out.append(prev)
    return out


def kv_of(h: bytes) -> float:
    """The KV every block with hash ``h`` holds (what a forward would compute for it)."""
    return float(int.from_bytes(h[:2], "little"))


def request(req_id: str, hashes: list[bytes], num_tokens: int) -> Any:
    meta = {"session_id": "run:A", "run_id": "run", "node": "A"}
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=hashes,
        num_tokens=num_tokens,
        num_computed_tokens=0,
        kv_transfer_params={"tokencake": meta},
    )


def begin(stall_id: str) -> StallBegin:
    return StallBegin(
        stall_id=stall_id, session_id="run:A", run_id="run", node="A", tool="t", predicted_s=10.0, ts=0
    )


def end(stall_id: str) -> StallEnd:
    return StallEnd(
        stall_id=stall_id, session_id="run:A", run_id="run", node="A", tool="t", duration_s=1.0, ts=0
    )


class Engine:
    """A scheduler side and a worker side joined the way vLLM joins them, one step at a time."""

    def __init__(self, faults: Faults, *, job_timeout_s: float = 60.0, stamp_timeout: bool = False) -> None:
        self.clock = Clock()
        self.pool = BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, hash_block_size=BS)
        opts = Options(
            usage_threshold=0.0, prefetch_reserve_frac=0.0, prefetch=False, job_timeout_s=job_timeout_s
        )
        self.side = SchedulerSide(
            block_size=BS, block_bytes=1, num_host_blocks=HOST_BLOCKS, options=opts, clock=self.clock
        )
        self.side.bind_pool(self.pool)
        self.kv = torch.zeros((NUM_BLOCKS, 2, BS, 8))
        self.worker = WorkerSide(
            NUM_BLOCKS, HOST_BLOCKS, faults=faults, clock=self.clock, sleep=self.clock.sleep
        )
        self.worker.register_kv_caches({"layer.0": self.kv})
        #: What the scheduler side of a future version does: tell the worker its timeout.
        self.stamp_timeout = stamp_timeout
        self.load_errors: set[int] = set()
        self.reported: TokenCakeWorkerMeta | None = None
        #: False: behave like a scheduler that predates ``release_after_report``.
        self.handshake = True

    def step(self) -> TokenCakeMetadata:
        meta = self.side.build_meta()
        if self.stamp_timeout:
            for job in meta.jobs:
                job.timeout_s = self.side.opts.job_timeout_s
        if not self.handshake:
            meta.release_after_report = False
        self.worker.before_forward(meta)  # bind_connector_metadata
        if meta.jobs:
            self.worker.start_jobs(meta)  # start_load_kv
        self.worker.start_saves()  # wait_for_save, after the forward
        self.load_errors |= self.worker.take_load_errors()
        self.reported = self.worker.take_results()
        self.side.on_worker_meta(self.reported)
        return meta

    def finish_turn(self, hashes: list[bytes], req_id: str) -> None:
        """A request computed ``hashes`` (the forward wrote their KV) and finished."""
        req = request(req_id, hashes, len(hashes) * BS + 2)
        self.side.on_new_request(req)
        blocks = bp.allocate(self.pool, len(hashes))
        for i, (b, h) in enumerate(zip(blocks, hashes, strict=True)):
            bp.register(self.pool, b, h, (i + 1) * BS)
            self.kv[b.block_id] = kv_of(h)
        req.num_computed_tokens = len(hashes) * BS + 1
        self.side.request_finished(req)
        bp.release(self.pool, blocks)

    def evict_all(self) -> None:
        blocks = bp.allocate(self.pool, bp.num_free(self.pool))
        for b in blocks:
            self.kv[b.block_id] = -1.0  # another request's KV
        bp.release(self.pool, blocks)

    def demand_load(self, hashes: list[bytes], req_id: str) -> tuple[list[int], int]:
        """The session's next request arrives; returns (allocated ids, blocks planned from host)."""
        req = request(req_id, [*hashes, *chain(req_id, 1)], (len(hashes) + 1) * BS + 2)
        self.side.on_new_request(req)
        tokens = self.side.get_num_new_matched_tokens(req, 0) or 0
        blocks = bp.allocate(self.pool, len(hashes) + 2)
        ids = [b.block_id for b in blocks]
        self.side.update_state_after_alloc(req, ids, tokens)
        self.step()
        return ids, tokens // BS

    def release(self, ids: list[int]) -> None:
        bp.release(self.pool, [self.pool.blocks[i] for i in ids])

    def assert_settled(self) -> None:
        assert not self.side.copies.jobs and not self.worker.busy
        assert all(b.ref_cnt == 0 for b in self.pool.blocks[1:]), "a device block stayed pinned"
        assert self.side.host.num_filling == 0


def test_failed_offload_leaves_nothing_on_host() -> None:
    eng = Engine(Faults(copy_fail=1.0, kinds=frozenset({"offload"})))
    hashes = chain("a", 3)
    eng.finish_turn(hashes, "r1")
    eng.side.handle_event(begin("s1"))
    (job,) = eng.step().jobs
    assert job.kind == "offload"
    assert eng.side.stats.counter("offload.failed") == 1
    assert all(eng.side.host.lookup(h) is None for h in hashes)
    eng.assert_settled()


def test_failed_demand_load_is_recomputed_and_its_host_copy_dropped() -> None:
    eng = Engine(Faults())
    hashes = chain("b", 3)
    eng.finish_turn(hashes, "r1")
    eng.side.handle_event(begin("s1"))
    eng.step()
    assert all(eng.side.host.lookup(h) is not None for h in hashes)  # offloaded
    eng.evict_all()
    eng.side.handle_event(end("s1"))
    eng.step()
    eng.worker.faults = Faults(copy_fail=1.0, kinds=frozenset({"load"}))
    ids, loaded = eng.demand_load(hashes, "r2")
    assert loaded == 3
    assert eng.load_errors == set(ids[:3])  # vLLM recomputes exactly these blocks
    assert all(eng.side.host.lookup(h) is None for h in hashes)  # the suspect copies are gone
    assert eng.side.stats.counter("load.failed") == 1
    eng.release(ids)
    eng.assert_settled()


def test_stalled_copy_takes_the_timeout_path_without_crashing() -> None:
    """The scheduler stops waiting after ``job_timeout_s`` but keeps the job's pins until the
    late report (the handshake): the copy never writes into blocks or slots handed to others,
    nothing is committed, and nothing raises on either side."""
    eng = Engine(Faults(copy_stall=1.0, copy_stall_s=5.0), job_timeout_s=1.0)
    hashes = chain("c", 2)
    eng.finish_turn(hashes, "r1")
    eng.side.handle_event(begin("s1"))
    meta = eng.step()
    assert meta.release_after_report and meta.jobs[0].timeout_s == 1.0
    assert eng.worker.busy and eng.side.has_pending_work()
    eng.clock.t += 1.5
    eng.step()
    assert eng.side.stats.counter("jobs.timed_out") == 1  # the timeout path
    assert not eng.side.has_pending_work()  # a hung copy does not keep the engine spinning
    (job,) = eng.side.copies.jobs.values()
    assert job.abandoned
    assert all(b.ref_cnt > 0 for b in job.device_blocks)  # still pinned: the copy may be reading
    assert all(eng.side.host.lookup(h) is None for h in hashes)  # never committed
    eng.clock.t += 4.0
    eng.step()  # the copy lands late; its report releases the pins and commits nothing
    assert eng.reported is not None and eng.reported.results[1].ok
    assert eng.side.stats.counter("jobs.late_reports") == 1
    assert eng.side.stats.counter("offload.blocks") == 0
    assert not eng.side.copies.jobs
    eng.assert_settled()


def test_an_old_scheduler_without_the_handshake_gets_a_fenced_copy() -> None:
    """A scheduler that releases at its timeout (no ``release_after_report``) but stamps
    ``CopyJob.timeout_s``: the worker fences the copy at half of it, so the scheduler gets its
    report in time and never frees blocks under it."""
    eng = Engine(Faults(copy_stall=1.0, copy_stall_s=5.0), job_timeout_s=10.0, stamp_timeout=True)
    eng.handshake = False
    hashes = chain("d", 2)
    eng.finish_turn(hashes, "r1")
    eng.side.handle_event(begin("s1"))
    eng.step()
    eng.clock.t += 5.5  # past half the timeout: the next step fences the copy
    eng.step()
    assert eng.worker.counters["fenced"] == 1
    assert eng.side.stats.counter("jobs.timed_out") == 0
    assert all(eng.side.host.lookup(h) is not None for h in hashes)  # committed, byte-exact below
    for h in hashes:
        assert torch.all(eng.worker.copier.host_tensors[0][eng.side.host.lookup(h)] == kv_of(h))
    eng.assert_settled()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_faults_never_serve_wrong_kv(seed: int) -> None:
    """Many stall cycles under random failures and stalls: every block that a load did not report
    failed holds the KV of its hash, and nothing is left pinned."""
    faults = Faults(copy_fail=0.3, copy_stall=0.3, copy_stall_s=0.4, seed=seed)
    eng = Engine(faults, job_timeout_s=1.0, stamp_timeout=True)
    served = failed = 0
    for turn in range(12):
        hashes = chain(f"s{seed}-{turn % 3}", 3)  # sessions come back with shared prefixes
        eng.finish_turn(hashes, f"r{turn}")
        eng.side.handle_event(begin(f"st{turn}"))
        for _ in range(3):
            eng.step()
            eng.clock.t += 0.3
        eng.evict_all()
        eng.side.handle_event(end(f"st{turn}"))
        eng.step()
        eng.load_errors.clear()
        ids, loaded = eng.demand_load(hashes, f"n{turn}")
        eng.clock.t += 0.3
        for i, h in zip(ids[:loaded], hashes, strict=False):
            if i in eng.load_errors:
                failed += 1
            else:
                served += 1
                assert torch.all(eng.kv[i] == kv_of(h)), "a load reported fine but the KV is wrong"
        eng.release(ids)
        for _ in range(4):  # let stalled copies land and time out
            eng.clock.t += 0.5
            eng.step()
    assert served > 0 and eng.worker.counters.get("faults.copy_fail", 0) > 0
    assert eng.worker.counters.get("faults.copy_stall", 0) > 0
    assert eng.side.stats.counter("jobs.timed_out") == 0  # stalls were fenced in time
    eng.assert_settled()
