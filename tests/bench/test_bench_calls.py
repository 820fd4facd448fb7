import json

import anyio
import httpx
import pytest

from tokencake.bench.calls import CallRecorder


def _body(node="agent_0", run="r1", **extra):
    meta = {"session_id": f"{run}:{node}", "run_id": run, "node": node}
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": "a b c"}],
        "max_tokens": 8,
        "temperature": 0.7,
        "kv_transfer_params": {"tokencake": meta},
        **extra,
    }


def _post(recorder, body):
    async def main():
        async with httpx.AsyncClient(transport=recorder) as client:
            return await client.post("http://fake/v1/chat/completions", json=body)

    return anyio.run(main)


def test_overrides_are_forced_and_response_passes_through(fake_vllm):
    backend = fake_vllm()
    rec = CallRecorder(backend.transport(), overrides={"temperature": 0.0, "ignore_eos": True})
    response = _post(rec, _body())
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 8
    sent = backend.bodies[0]
    assert sent["temperature"] == 0.0 and sent["ignore_eos"] is True
    assert sent["kv_transfer_params"]["tokencake"]["node"] == "agent_0"


def test_records_usage_and_keys_by_session_ordinal(fake_vllm):
    rec = CallRecorder(fake_vllm().transport(), overrides={"ignore_eos": True})
    _post(rec, _body())
    _post(rec, _body(node="agent_1"))
    _post(rec, _body())
    keys = [r.key for r in rec.records]
    assert keys == ["r1/agent_0/0", "r1/agent_1/0", "r1/agent_0/1"]
    first = rec.records[0]
    assert first.status == 200 and first.prompt_tokens == 3 and first.completion_tokens == 8
    assert first.finish_reason == "length" and first.text_sha1 and first.latency_s >= 0
    assert json.loads(json.dumps(first.to_dict()))["latency_s"] >= 0


def test_other_requests_are_not_recorded_or_changed(fake_vllm):
    backend = fake_vllm()
    rec = CallRecorder(backend.transport(), overrides={"ignore_eos": True})

    async def main():
        async with httpx.AsyncClient(transport=rec) as client:
            return await client.get("http://fake/metrics")

    assert anyio.run(main).status_code == 200
    assert rec.records == []


def test_http_errors_and_transport_failures_are_recorded():
    def handler(request):
        if request.url.host == "down":
            raise httpx.ConnectError("refused")
        return httpx.Response(400, json={"error": "bad"})

    rec = CallRecorder(httpx.MockTransport(handler))
    assert _post(rec, _body()).status_code == 400
    assert rec.records[0].status == 400 and "bad" in rec.records[0].error

    async def main():
        async with httpx.AsyncClient(transport=rec) as client:
            await client.post("http://down/v1/chat/completions", json=_body())

    with pytest.raises(httpx.ConnectError):
        anyio.run(main)
    assert rec.records[1].status == 0 and "ConnectError" in rec.records[1].error
