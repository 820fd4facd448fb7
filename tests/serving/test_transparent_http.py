"""Transparent mode's ASGI plumbing: vLLM's API key rule (digests only), the body rewrite for every
encoding ``json.loads`` accepts, and a replay that keeps no body once handed on."""

from __future__ import annotations

import asyncio
import codecs
import json
from typing import Any

import pytest

from tokencake.events import RequestMeta
from tokencake.serving.transparent_http import ApiKeys, header, replay, request_path, with_meta

META = RequestMeta(session_id="s", run_id="s", node="transparent", turn=2)
DOC = {"model": "m", "messages": [{"role": "user", "content": "Wetter in München? ☀"}]}


def scope(token: str | None, app: Any = None) -> dict[str, Any]:
    headers = [(b"authorization", f"bearer {token}".encode())] if token is not None else []
    return {"headers": headers, "app": app}


def test_the_api_key_rule_is_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    keys = ApiKeys()
    assert keys.allows(scope("env-key")) and not keys.allows(scope("other")) and not keys.allows(scope(None))
    assert not keys.allows({"headers": [(b"authorization", b"Basic env-key")]})
    app = type("App", (), {"state": type("State", (), {"args": type("Args", (), {"api_key": ["a1", "a2"]})})})
    keys2 = ApiKeys()  # --api-key wins over VLLM_API_KEY
    assert keys2.allows(scope("a2", app)) and not keys2.allows(scope("env-key", app))
    monkeypatch.delenv("VLLM_API_KEY")
    assert ApiKeys().allows(scope(None))  # no key: every request passes
    assert ApiKeys(["k\u00e9y"]).allows(
        {"headers": [(b"authorization", "Bearer k\u00e9y".encode("latin-1"))]}
    )


def test_only_the_keys_digests_are_kept() -> None:
    keys = ApiKeys(["client-key"])
    assert keys.allows(scope("client-key"))
    held = json.dumps([k.hex() for k in keys._digests or []])
    assert "client-key" not in held and b"client-key" not in b"".join(keys._digests or [])


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "utf-16-le", "utf-16-be", "utf-16", "utf-32"])
def test_the_rewritten_body_parses_whatever_json_encoding_the_client_used(encoding: str) -> None:
    body = json.dumps(DOC, ensure_ascii=False).encode(encoding)
    assert json.loads(body) == DOC  # what stock vLLM reads
    out = with_meta(body, DOC, META)
    doc = json.loads(out)
    assert doc.pop("kv_transfer_params")["tokencake"]["turn"] == 2 and doc == DOC
    spliced = encoding == "utf-8"  # the client's bytes kept behind the spliced field
    assert out.endswith(body[1:]) is spliced
    if encoding == "utf-8-sig":
        assert not out.startswith(codecs.BOM_UTF8)


def test_a_body_with_kv_transfer_params_keeps_them() -> None:
    doc = {**DOC, "kv_transfer_params": {"other": 1}}
    out = json.loads(with_meta(json.dumps(doc).encode(), doc, META))
    assert (
        out["kv_transfer_params"]["other"] == 1
        and out["kv_transfer_params"]["tokencake"]["session_id"] == "s"
    )
    assert json.loads(with_meta(b"{}", {}, META))["kv_transfer_params"]["tokencake"]["turn"] == 2


def test_replay_hands_each_message_on_once() -> None:
    messages = [{"type": "http.request", "body": b"x" * 100, "more_body": False}]

    async def later() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def scenario() -> list[dict[str, Any]]:
        receive = replay(messages, later)
        return [await receive(), await receive()]

    first, second = asyncio.run(scenario())
    assert first["body"] == b"x" * 100 and second["type"] == "http.disconnect"
    assert messages == []  # the caller's list no longer holds the body


def test_headers_and_paths() -> None:
    s = {"headers": [(b"X-A", b"1"), (b"x-a", b"2")], "path": "/api/v1/x/", "root_path": "/api"}
    assert header(s, b"x-a") == "1" and header(s, b"x-b") is None
    assert request_path(s) == "/v1/x"
