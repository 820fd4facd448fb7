"""The KV report of a resumed tool call: from the server's ``tokencake_kv`` provenance."""

import tokencake as tc
from tokencake.integrations._kv import Resumes, ToolCallRef, kv_report, otel_attributes, provenance


def test_the_decision_follows_where_the_prompt_kv_came_from():
    kv = tc.testing.kv_provenance
    assert kv_report(kv(100, loaded_tokens=64, prefetched_tokens=16))["decision"] == "loaded"
    assert kv_report(kv(100, kept_tokens=16, prefetched_tokens=48))["decision"] == "prefetched"
    assert kv_report(kv(100, kept_tokens=80))["decision"] == "kept"
    assert kv_report(kv(100))["decision"] == "recomputed"
    report = kv_report(kv(120, kept_tokens=16, prefetched_tokens=32, loaded_tokens=16), context_tokens=80)
    assert report == {
        "decision": "loaded",
        "offloaded": True,
        "kept_tokens": 16,
        "loaded_tokens": 16,
        "prompt_tokens": 120,
        "prefetched_tokens": 32,
        "admissions": 1,
        "failed_copy_tokens": 0,
        "failed_load_tokens": 0,
        "recomputed_tokens": 80 - 48 - 16,  # of the 80 tokens the conversation had, 64 were found
    }
    assert "recomputed_tokens" not in kv_report(kv(10))  # without the context's size: unknown


def test_provenance_is_read_from_kv_transfer_params_only_when_present():
    assert provenance({"tokencake_kv": {"device_tokens": 16, "note": "x"}}) == {"device_tokens": 16}
    assert provenance({"other": 1}) is None and provenance(None) is None


def test_resumes_pair_each_sessions_tool_calls_with_its_next_response():
    resumes = Resumes(max_sessions=2)
    resumes.resumed("s", None, prompt_tokens=30, completion_tokens=10)  # the turn that called the tools
    resumes.ended(ToolCallRef("s", "search", "st-1", "c1"))
    resumes.ended(ToolCallRef("s", "fetch", "st-2", "c2"))
    resumes.ended(ToolCallRef("other", "search", "st-3"))
    out = resumes.resumed(
        "s", tc.testing.kv_provenance(60, kept_tokens=32), prompt_tokens=60, completion_tokens=5
    )
    assert [(call.tool, report["tool_call_id"], report["recomputed_tokens"]) for call, report in out] == [
        ("search", "c1", 40 - 32),
        ("fetch", "c2", 40 - 32),
    ]
    assert resumes.resumed("s", tc.testing.kv_provenance(70), prompt_tokens=70, completion_tokens=1) == []
    # a response without provenance (a server without the extension) resumes them without a report
    assert resumes.resumed("other", None, prompt_tokens=1, completion_tokens=1) == []
    resumes.ended(ToolCallRef("a", "t", "x"))
    resumes.ended(ToolCallRef("b", "t", "y"))
    resumes.ended(ToolCallRef("c", "t", "z"))  # bounded: the oldest session is forgotten
    assert resumes.resumed("a", tc.testing.kv_provenance(1), prompt_tokens=1, completion_tokens=1) == []


def test_otel_attributes_are_prefixed_and_leave_out_none():
    assert otel_attributes({"tool": "search", "tool_call_id": None, "kept_tokens": 3}) == {
        "tokencake.kv.tool": "search",
        "tokencake.kv.kept_tokens": 3,
    }
