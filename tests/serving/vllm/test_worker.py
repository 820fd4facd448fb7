"""Worker-side job execution on CPU tensors: round trips, failure reporting, result aggregation."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from tokencake.serving.vllm.metadata import (  # noqa: E402
    CopyJob,
    JobResult,
    TokenCakeMetadata,
    TokenCakeWorkerMeta,
)
from tokencake.serving.vllm.worker import WorkerSide  # noqa: E402


def _worker(num_blocks: int = 10, host: int = 4) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    caches = {f"l{i}": torch.randn((num_blocks, 2, 8, 4), generator=gen).to(torch.bfloat16) for i in range(2)}
    w = WorkerSide(num_blocks, host)
    w.register_kv_caches(caches)
    return w, caches


def test_offload_then_load_round_trip() -> None:
    w, caches = _worker()
    before = {k: v.clone() for k, v in caches.items()}
    w.start_jobs(TokenCakeMetadata([CopyJob(1, "offload", [2, 3], [0, 1])]))
    w.start_saves()
    res = w.take_results()
    assert res is not None and res.results[1].ok and res.results[1].nbytes == 2 * w.copier.block_bytes
    assert w.take_results() is None  # reported once
    w.start_jobs(TokenCakeMetadata([CopyJob(2, "load", [7, 8], [0, 1], req_id="r")]))
    for name, t in caches.items():
        assert torch.equal(t[7], before[name][2]) and torch.equal(t[8], before[name][3])
    assert w.take_results().results[2].ok
    assert w.take_load_errors() == set()


def test_failed_load_is_reported_by_block_and_job() -> None:
    w, _ = _worker()
    w.start_jobs(TokenCakeMetadata([CopyJob(5, "load", [1, 99], [0, 1], req_id="r")]))
    res = w.take_results()
    assert res is not None and not res.results[5].ok and "IndexError" in (res.results[5].error or "")
    assert w.take_load_errors() == {1, 99}
    assert w.take_load_errors() == set()


def test_invalid_job_copies_nothing_and_reports_blocks() -> None:
    w, caches = _worker()
    before = caches["l0"].clone()
    w.start_jobs(TokenCakeMetadata([CopyJob(0, "load", [4, 5], [], req_id="r", invalid=True)]))
    assert w.take_load_errors() == {4, 5}
    assert torch.equal(caches["l0"], before)


def test_same_job_is_never_run_twice() -> None:
    w, _ = _worker()
    meta = TokenCakeMetadata([CopyJob(9, "offload", [1], [0])])
    w.start_jobs(meta)
    w.start_saves()
    w.take_results()
    w.start_jobs(meta)
    w.start_saves()
    assert w.take_results() is None


def test_no_host_pool_fails_jobs_instead_of_raising() -> None:
    w = WorkerSide(10, 4)
    w.register_kv_caches({})  # allocation fails: no tensors
    assert w.error
    w.start_jobs(TokenCakeMetadata([CopyJob(1, "load", [1], [0], req_id="r")]))
    assert not w.take_results().results[1].ok
    assert w.take_load_errors() == {1}


def test_worker_meta_aggregates_across_workers() -> None:
    a = TokenCakeWorkerMeta({1: JobResult(True, 0.1, 10), 2: JobResult(True, 0.2, 10)})
    b = TokenCakeWorkerMeta({1: JobResult(False, 0.3, 10, "boom")})
    merged = a.aggregate(b)
    assert isinstance(merged, TokenCakeWorkerMeta)
    assert merged.results[1] == JobResult(False, 0.3, 20, "boom", workers=2)
    assert merged.results[2].workers == 1
    assert not TokenCakeWorkerMeta() and bool(a)


def test_offloads_copy_after_the_forward_not_before() -> None:
    """Regression (stale KV): a block hashed this step holds its KV only after the step's forward.

    ``start_load_kv`` runs before the forward in a step with synchronous loads; an offload started
    there copies whatever the block held before, and that copy would be committed under the hash.
    """
    w, caches = _worker()
    meta = TokenCakeMetadata(
        [CopyJob(1, "load", [6], [3], req_id="r"), CopyJob(2, "offload", [2, 3], [0, 1])]
    )
    w.start_jobs(meta)  # start_load_kv, before the forward (the step has a demand load)
    assert w.busy
    forward = {k: torch.full_like(v[2:4], 7.0) for k, v in caches.items()}
    for k, t in caches.items():  # the forward writes the freshly allocated blocks
        t[2:4] = forward[k]
    w.start_saves()  # wait_for_save, after the forward
    res = w.take_results()
    assert res is not None and res.results[1].ok and res.results[2].ok
    for host, k in zip(w.copier.host_tensors, caches, strict=True):
        assert torch.equal(host[0:2], forward[k]), "the host copy must hold what the forward computed"
