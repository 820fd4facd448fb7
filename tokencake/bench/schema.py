"""JSON schema of ``results.json`` (draft 2020-12), for consumers and for the tests.

It pins the fields a reader can rely on; everything else (raw per-call rows, extension stats) may grow.
"""

from __future__ import annotations

from typing import Any

_NUM = {"type": ["number", "null"]}
_STATS = {
    "type": "object",
    "required": ["count", "mean", "p50", "p95", "p99"],
    "properties": {k: _NUM for k in ("count", "mean", "p50", "p95", "p99", "min", "max")},
}

_SYSTEM = {
    "type": "object",
    "required": ["system", "replay_s", "server_start_s", "apps", "calls", "client", "server", "kv"],
    "properties": {
        "system": {
            "type": "object",
            "required": ["name", "stock", "kv", "flags"],
            "properties": {"name": {"type": "string"}, "stock": {"type": "boolean"}},
        },
        "num_gpu_blocks": {"type": ["integer", "null"]},
        "served": {
            "type": "object",
            "properties": {"dtype": {"type": "string"}, "scheduling_policy": {"type": "string"}},
        },
        "replay_s": {"type": "number"},
        "server_start_s": {"type": "number"},
        "apps": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "app", "run_id", "status", "e2e_s"],
                "properties": {"status": {"enum": ["ok", "failed"]}, "e2e_s": {"type": "number"}},
            },
        },
        "calls": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "status", "latency_s", "prompt_tokens", "completion_tokens"],
            },
        },
        "client": {
            "type": "object",
            "required": ["apps", "apps_failed", "e2e_s", "call_latency_s", "node_breakdown_s"],
            "properties": {"e2e_s": _STATS, "call_latency_s": _STATS},
        },
        "server": {
            "type": "object",
            "required": [
                "prompt_tokens",
                "computed_prompt_tokens",
                "prompt_tokens_by_source",
                "prefix_cache_queries",
                "prefix_cache_hits",
                "preemptions",
                "histograms",
            ],
            "properties": {
                "histograms": {
                    "type": "object",
                    "required": ["ttft_s", "queue_s"],
                    "additionalProperties": {
                        "type": "object",
                        "required": ["count", "mean", "p50", "p95", "p99"],
                    },
                }
            },
        },
        "extension": {"type": ["object", "null"]},
        "kv": {
            "type": "object",
            "required": ["series", "mean", "max"],
            "properties": {
                "series": {
                    "type": "array",
                    "items": {"type": "object", "required": ["t", "kv_usage"]},
                }
            },
        },
    },
}

RESULTS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "tokencake bench results",
    "type": "object",
    "required": [
        "schema_version",
        "kind",
        "preset",
        "started",
        "finished",
        "wall_s",
        "valid",
        "warnings",
        "config",
        "versions",
        "machine",
        "points",
    ],
    "properties": {
        "schema_version": {"const": 1},
        "kind": {"const": "tokencake-bench"},
        "valid": {"type": "boolean"},
        "warnings": {"type": "array", "items": {"type": "string"}},
        "failed_systems": {"type": "array", "items": {"type": "string"}},
        "system_orders": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["round", "point", "order"],
                "properties": {"order": {"type": "array", "items": {"type": "string"}}},
            },
        },
        "aggregate": {"type": ["object", "null"]},
        "config": {"type": "object", "required": ["preset", "systems", "server"]},
        "versions": {"type": "object", "required": ["tokencake", "python", "vllm"]},
        "machine": {"type": "object", "required": ["platform", "cpu_count"]},
        "points": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["label", "workload", "systems", "equal_work", "comparison"],
                "properties": {
                    "workload": {
                        "type": "object",
                        "required": [
                            "name",
                            "seed",
                            "arrival",
                            "num_apps",
                            "mix",
                            "latency",
                            "llm",
                            "arrivals",
                        ],
                    },
                    "systems": {"type": "object", "additionalProperties": _SYSTEM},
                    "equal_work": {
                        "type": "object",
                        "required": [
                            "passed",
                            "calls_compared",
                            "output_token_mismatch_count",
                            "missing_call_count",
                        ],
                        "properties": {"passed": {"type": "boolean"}},
                    },
                    "comparison": {"type": "object"},
                    "system_order": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
