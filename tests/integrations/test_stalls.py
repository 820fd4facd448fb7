"""The blocking form of a stall (sync tools, e.g. LangGraph's ``invoke``)."""

import threading

import httpx
import pytest

import tokencake as tc
from tokencake.integrations._stalls import blocking


def test_blocking_stalls_share_one_loop_and_one_client_across_threads():
    # One event loop per event used to build a new httpx client (and connection) for every
    # begin and end, and drop the old one unclosed; threads could get another loop's client.
    seen: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        seen.append(request.read().decode())
        return httpx.Response(200, json={"ok": True, "status": "recorded"})

    reporter = tc.HttpStallReporter("http://events.test", transport=httpx.MockTransport(server))
    made = 0
    factory = reporter._client._factory

    def counting():
        nonlocal made
        made += 1
        return factory()

    reporter._client._factory = counting
    session = tc.Session("s", events_url=False, hooks=reporter)

    def tool_calls(n: int) -> None:
        for _ in range(n):
            with blocking(tc.stall(session, "search", predicted_s=1.0)):
                pass

    threads = [threading.Thread(target=tool_calls, args=(5,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 30 and reporter.sent == 30
    assert made == 1


def test_an_exception_in_the_block_ends_the_stall_and_propagates():
    rec = tc.StallRecorder()
    session = tc.Session("s", events_url=False, hooks=rec)
    with pytest.raises(KeyError), blocking(tc.stall(session, "search")):
        raise KeyError("boom")
    ((_begin, end),) = rec.pairs()
    assert end is not None and end.outcome == "error"
