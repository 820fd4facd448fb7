"""KV usage sampled from /metrics over a replay, and the critical reserve's series."""

import anyio

from tokencake.bench.kv_sampler import KVSampler


def test_kv_sampler_collects_and_survives_errors():
    texts = iter(["vllm:kv_cache_usage_perc 0.25\nvllm:num_requests_waiting 2\n", None])

    async def fetch():
        t = next(texts)
        if t is None:
            raise OSError("down")
        return t

    sampler = KVSampler(fetch, interval_s=0.01, clock=iter([10.0, 11.0]).__next__)

    async def main():
        await sampler.sample_once()
        await sampler.sample_once()

    anyio.run(main)
    assert sampler.errors == 1
    s = sampler.summary(t0=9.0)
    assert s["series"] == [{"t": 1.0, "kv_usage": 0.25, "running": 0.0, "waiting": 2.0}]
    assert s["max"] == 0.25 and s["max_waiting"] == 2.0


def test_kv_sampler_turns_the_reserve_counters_into_a_series():
    def text(block_steps: float, steps: float) -> str:
        return (
            "vllm:kv_cache_usage_perc 0.5\n"
            f'vllm:tokencake_spatial_reserved_block_steps_total{{engine="0"}} {block_steps}\n'
            f'vllm:tokencake_spatial_steps_total{{engine="0"}} {steps}\n'
        )

    texts = iter([text(0, 0), text(30, 10), text(30, 10), text(50, 20)])

    async def fetch():
        return next(texts)

    sampler = KVSampler(fetch, interval_s=0.01, clock=iter([1.0, 2.0, 3.0, 4.0]).__next__)

    async def main():
        for _ in range(4):
            await sampler.sample_once()

    anyio.run(main)
    series = sampler.summary(t0=0.0)["series"]
    # 30 block-steps over 10 steps = 3 blocks; no step in between = no value; then 20 / 10 = 2.
    assert [p.get("reserved_blocks") for p in series] == [None, 3.0, None, 2.0]
