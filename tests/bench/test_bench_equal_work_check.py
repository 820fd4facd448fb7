"""The equal-work check: the same output tokens for every call on every system."""

from tokencake.bench.equal_work_check import equal_work


def _calls(tokens, key_prefix="r/agent/"):
    return [
        {"key": f"{key_prefix}{i}", "completion_tokens": t, "prompt_tokens": 100, "text_sha1": "x"}
        for i, t in enumerate(tokens)
    ]


def test_equal_work_passes_on_identical_counts():
    check = equal_work(
        {"baseline": _calls([16, 16]), "tokencake": _calls([16, 16]), "ideal": _calls([16, 16])}
    )
    assert check.ok and check.calls == 2 and not check.mismatched


def test_equal_work_detects_different_output_counts():
    check = equal_work({"baseline": _calls([16, 16]), "tokencake": _calls([16, 9])})
    assert not check.ok
    assert check.mismatched == [{"key": "r/agent/1", "completion_tokens": {"baseline": 16, "tokencake": 9}}]
    assert check.to_dict()["passed"] is False


def test_equal_work_detects_missing_calls_and_counts_text_differences():
    a = _calls([16, 16, 16])
    b = _calls([16, 16])
    b[0]["text_sha1"] = "y"
    check = equal_work({"baseline": a, "tokencake": b})
    assert not check.ok
    assert check.missing == [{"key": "r/agent/2", "missing_in": ["tokencake"]}]
    assert check.text_mismatched == 1
    assert not equal_work({"baseline": [], "tokencake": []}).ok  # nothing compared is not a pass


def test_a_prompt_mismatch_passes_only_when_an_earlier_output_explains_it():
    a = _calls([16, 16, 16])
    b = _calls([16, 16, 16])
    b[1]["text_sha1"] = "y"  # turn 1's output text differs: turn 2's prompt may differ
    b[2]["prompt_tokens"] = 101
    check = equal_work({"baseline": a, "tokencake": b})
    assert check.ok and check.prompt_mismatched == 1 and check.prompt_unexplained == []
    # The same prompt difference with no output difference before it: not the same work.
    c = _calls([16, 16, 16])
    c[2]["prompt_tokens"] = 101
    bad = equal_work({"baseline": a, "tokencake": c})
    assert not bad.ok and bad.prompt_unexplained == ["r/agent/2"]
    assert bad.to_dict()["unexplained_prompt_mismatch_count"] == 1
    # A join reads the other nodes' outputs: a worker's text difference explains its prompt.
    worker = _calls([16], key_prefix="r/worker/")
    join = _calls([16], key_prefix="r/join/")
    worker2 = [dict(worker[0], text_sha1="z")]
    join2 = [dict(join[0], prompt_tokens=120)]
    assert equal_work({"a": worker + join, "b": worker2 + join2}).ok
    # ... but not across runs.
    other_run = [dict(worker2[0], key="q/worker/0")]
    assert not equal_work(
        {"a": [*worker, *join, dict(worker[0], key="q/worker/0")], "b": [*worker, *join2, *other_run]}
    ).ok
