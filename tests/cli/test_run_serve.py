"""``run --serve`` / ``--compare-baseline`` figures: the KV summary, resumed turns, the comparison table."""

from __future__ import annotations

import io

from rich.console import Console

from tokencake.agents import catalog
from tokencake.cli._run_serve import compare_table, kv_summary, resumed_turn_latencies, run_figures


def test_kv_summary_says_what_the_extension_did() -> None:
    counters = {
        "events.stall_begin": 10,
        "stalls.decision.offload": 3,
        "stalls.decision.already_on_host": 2,
        "stalls.decision.no_pressure": 5,
        "next_turn.requests": 8,
        "next_turn.prefix_tokens": 4096,
        "next_turn.prefix_tokens_device": 2048,
        "next_turn.prefix_tokens_host": 1536,
        "next_turn.prefix_tokens_recomputed": 512,
        "offload.bytes": 12_000_000,
        "offload.blocks": 12,
        "prefetch.bytes": 8_000_000,
        "prefetch.on_time": 2,
        "prefetch.late": 1,
        "demand_load.blocks": 4,
        "tokens.from_host": 1536,
    }
    text = "\n".join(kv_summary(counters))
    assert "tool calls (stalls): 10" in text and "offload 3" in text and "already on host 2" in text
    assert "4,096 tokens = device 2,048 + host 1,536 + recomputed 512" in text
    assert "offload 12.0 MB" in text and "on time 2, late 1" in text and "no KV pressure" not in text
    assert "time to first token" not in text  # no histogram given
    ttft = {"count": 8, "mean": 0.41, "p90": 0.9, "max": 1.2}
    text = "\n".join(kv_summary(counters, {"next_turn.ttft_s": ttft}))
    assert "time to first token: mean 0.41 s · p90 0.90 s · max 1.20 s (8 turns)" in text
    quiet = kv_summary({"events.stall_begin": 3, "stalls.decision.no_pressure": 3})
    assert any("no KV pressure" in line for line in quiet)
    assert "no tool calls" in kv_summary({})[0]


def test_resumed_turns_are_the_llm_calls_after_a_tool() -> None:
    app = catalog.get_app("rag", latency="scaled:0")
    result = app.run_sync(llm=catalog.scripted_llm("rag"), **catalog.default_inputs("rag"))
    calls = [e for e in result.events if e.kind == "llm_finished"]
    tools = [e for e in result.events if e.kind == "tool_finished"]
    assert len(calls) >= 2 and tools
    resumed = resumed_turn_latencies(result)
    # rag is one agent: LLM → tools → LLM; every call that follows a tool call counts, once.
    assert 1 <= len(resumed) <= min(len(tools), len(calls) - 1)
    assert all(x >= 0 for x in resumed)
    metrics = {'vllm:prompt_tokens_by_source_total{source="local_compute"}': 900.0}
    figures = run_figures(result, metrics)
    assert figures["resumed"] == len(resumed) and figures["computed_prompt_tokens"] == 900.0
    assert figures["status"] == "ok" and figures["prompt_tokens"] is None


def test_compare_table_puts_both_systems_side_by_side() -> None:
    ext = {"status": "ok", "wall_s": 30.0, "llm_s": 20.0, "resumed": 4, "resumed_mean_s": 1.0}
    base = {"status": "ok", "wall_s": 40.0, "llm_s": 30.0, "resumed": 4, "resumed_mean_s": 2.0}
    ext["computed_prompt_tokens"], base["computed_prompt_tokens"] = 5000.0, 10000.0
    console = Console(file=io.StringIO(), width=140, force_terminal=False)
    console.print(compare_table(ext, base))
    text = console.file.getvalue()
    assert "30.00 s" in text and "40.00 s" in text and "0.75" in text  # wall time and its ratio
    assert "5,000" in text and "10,000" in text and "0.50" in text
    assert "—" in text  # prompt tokens / preemptions not given
