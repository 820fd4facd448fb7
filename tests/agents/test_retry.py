"""Issue 13, SDK point 4f: retries with exponential backoff + jitter and ``retry_on``."""

import itertools
import random
import time

import httpx
import openai
import pytest

import tokencake as tc

pytestmark = pytest.mark.anyio


def test_delays_grow_exponentially_up_to_the_cap_with_bounded_jitter():
    policy = tc.Retry(5, backoff=0.1, multiplier=2.0, max_backoff=0.5, jitter=0.5)
    rng = random.Random(7)
    for retry, base in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (5, 0.5)]:
        delays = [policy.delay(retry, rng=rng) for _ in range(200)]
        assert all(base * 0.5 <= d <= base for d in delays), (retry, min(delays), max(delays))
        assert max(delays) - min(delays) > base * 0.3  # jitter really spreads the attempts
    exact = tc.Retry(3, backoff=0.1, jitter=0.0)
    assert [exact.delay(n) for n in (1, 2, 3)] == pytest.approx([0.1, 0.2, 0.4])
    assert exact.attempts == 4


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"retries": -1}, ValueError),
        ({"backoff": -0.1}, ValueError),
        ({"multiplier": 0.5}, ValueError),
        ({"jitter": 1.5}, ValueError),
        ({"retry_on": (int,)}, TypeError),
        ({"retry_on": ()}, TypeError),
    ],
)
def test_bad_policies_are_rejected(kwargs, error):
    with pytest.raises(error):
        tc.Retry(**kwargs)


async def test_tool_retries_back_off_exponentially_and_only_on_retry_on():
    app = tc.App("tool_retry")
    attempts: list[float] = []

    @app.tool(retries=tc.Retry(3, backoff=0.1, jitter=0.0), retry_on=ConnectionError)
    def flaky() -> str:
        attempts.append(time.perf_counter())
        if len(attempts) < 3:
            raise ConnectionError(f"try {len(attempts)}")
        return "ok"

    @app.agent(calls=[flaky])
    async def agent(ctx, inputs):
        return await ctx.call(flaky)

    result = await app.run(llm=tc.ScriptedLLM("x"))
    assert result.output == "ok"
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2, gaps
    finished = [e.data for e in result.events if e.kind == "tool_finished"]
    assert [d["retry_in_s"] for d in finished] == pytest.approx([0.1, 0.2, None])
    assert [d["outcome"] for d in finished] == ["error", "error", "ok"]
    assert app.get_tool(flaky).retry.retry_on == (ConnectionError,)


async def test_tool_error_outside_retry_on_is_not_retried():
    app = tc.App("no_retry")
    calls = []

    @app.tool(retries=3, retry_on=(ConnectionError, TimeoutError))
    def buggy() -> str:
        calls.append(1)
        raise KeyError("a bug, not an outage")

    @app.agent(calls=[buggy])
    async def agent(ctx, inputs):
        return await ctx.call(buggy)

    with pytest.raises(tc.NodeFailed) as info:
        await app.run(llm=tc.ScriptedLLM("x"))
    assert isinstance(info.value.__cause__, KeyError)
    assert len(calls) == 1


class _FlakyServer(tc.ScriptedLLM):
    """Answers the first ``failures`` chat requests with ``status``."""

    def __init__(self, *args, failures: int, status: int = 503, **kwargs):
        super().__init__(*args, **kwargs)
        self.failures = failures
        self.status = status
        self.attempts = 0

    async def _complete(self, body):
        self.attempts += 1
        if self.attempts <= self.failures:
            return httpx.Response(self.status, json={"error": {"message": f"overloaded ({self.attempts})"}})
        return await super()._complete(body)


def _asker(**llm_kwargs) -> tc.App:
    app = tc.App("llm_retry")

    @app.agent()
    async def asker(ctx, inputs):
        return (await ctx.llm("hi", **llm_kwargs)).text

    return app


async def test_llm_retry_backs_off_on_transient_errors_and_replaces_client_retries():
    llm = _FlakyServer("fine", failures=2, retry=tc.Retry(3, backoff=0.05, jitter=0.0))
    llm.max_retries = 5  # the openai client's own retries are switched off under a TokenCake policy
    t0 = time.perf_counter()
    result = await _asker().run(llm=llm)
    assert result.output == "fine"
    assert llm.attempts == 3  # exactly our attempts, no hidden client retries in between
    assert time.perf_counter() - t0 >= 0.15
    failed = [e.data for e in result.events if e.kind == "llm_failed"]
    assert [d["retry_in_s"] for d in failed] == pytest.approx([0.05, 0.1])
    assert [d["attempt"] for d in failed] == [1, 2]
    assert "InternalServerError" in failed[0]["error"]
    assert result.nodes["asker"].llm_calls == 3


async def test_llm_errors_outside_retry_on_fail_at_once_and_per_call_retry_overrides():
    llm = _FlakyServer("fine", failures=1, status=400, retry=3)
    with pytest.raises(tc.NodeFailed) as info:
        await _asker().run(llm=llm)
    assert isinstance(info.value.__cause__, openai.BadRequestError)
    assert llm.attempts == 1

    llm = _FlakyServer("fine", failures=1, status=400)
    result = await _asker(retry=tc.Retry(1, retry_on=openai.BadRequestError, backoff=0.0)).run(llm=llm)
    assert result.output == "fine" and llm.attempts == 2


def test_retry_option_types_are_checked():
    def f() -> None:
        return None

    with pytest.raises(tc.AppDefinitionError, match="retries"):
        tc.App("a").add_tool(f, retries="3")
    with pytest.raises(tc.AppDefinitionError, match="retry_on"):
        tc.App("b").add_tool(f, retries=1, retry_on="ConnectionError")
    with pytest.raises(TypeError):
        tc.LLM("http://x/v1", retry=1.5)
    assert tc.LLM("http://x/v1", retry=2, events_url=False).retry == tc.Retry(2)


async def test_per_call_policy_switches_off_the_client_retries_for_that_call():
    llm = _FlakyServer("fine", failures=3)
    llm.max_retries = 5  # the client would retry the 503s itself (and eventually succeed)
    with pytest.raises(tc.NodeFailed) as info:
        await _asker(retry=tc.Retry(1, backoff=0.0)).run(llm=llm)
    assert isinstance(info.value.__cause__, openai.InternalServerError)
    assert llm.attempts == 2  # our two attempts, nothing more
