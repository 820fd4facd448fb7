"""An in-process stand-in for a vLLM server (OpenAI chat + /metrics + extension /v1/stats) for bench tests.

It speaks the wire formats the benchmark reads, through ``httpx.MockTransport``: prompt tokens are counted
by whitespace, the completion has exactly ``max_tokens`` tokens when ``ignore_eos`` is set (``short_by``
makes it produce fewer, to exercise the equal-work check), and every request moves the Prometheus counters
the way a prefix cache would (``hit_fraction`` of the prompt is served from cache).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import httpx
import pytest

#: Where FakeServer's events listener "is": nothing listens there, so the SDK's stall reporter gets
#: connection refused at once (as with a server without the extension), while the benchmark's own
#: requests go through the MockTransport, which answers /v1/stats for this port.
EVENTS_PORT = 9


class FakeVLLM:
    def __init__(
        self, *, hit_fraction: float = 0.0, short_by: int = 0, stats: dict[str, float] | None = None
    ) -> None:
        self.hit_fraction = hit_fraction
        self.short_by = short_by
        #: Extension counters added per chat completion (None = a stock server without /v1/stats).
        self.stats = stats
        self.ext_counters: dict[str, float] = {}
        self.bodies: list[dict[str, Any]] = []
        self.warmups = 0
        self.c = {
            "prompt": 0.0,
            "computed": 0.0,
            "hit": 0.0,
            "gen": 0.0,
            "queries": 0.0,
            "hits": 0.0,
            "preempt": 0.0,
            "success": 0.0,
            "ttft_sum": 0.0,
            "ttft_count": 0.0,
            "ttft_le_0_1": 0.0,
            "ttft_le_1": 0.0,
        }

    def metrics_text(self) -> str:
        c = self.c
        lab = 'model_name="fake",engine="0"'
        return "\n".join(
            [
                "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
                "# TYPE vllm:prompt_tokens_total counter",
                f"vllm:prompt_tokens_total{{{lab}}} {c['prompt']}",
                f"vllm:generation_tokens_total{{{lab}}} {c['gen']}",
                f'vllm:prompt_tokens_by_source_total{{{lab},source="local_compute"}} {c["computed"]}',
                f'vllm:prompt_tokens_by_source_total{{{lab},source="local_cache_hit"}} {c["hit"]}',
                f'vllm:prompt_tokens_by_source_total{{{lab},source="external_kv_transfer"}} 0.0',
                f"vllm:prefix_cache_queries_total{{{lab}}} {c['queries']}",
                f"vllm:prefix_cache_hits_total{{{lab}}} {c['hits']}",
                f"vllm:num_preemptions_total{{{lab}}} {c['preempt']}",
                f'vllm:request_success_total{{{lab},finished_reason="length"}} {c["success"]}',
                f"vllm:kv_cache_usage_perc{{{lab}}} 0.5",
                f"vllm:num_requests_running{{{lab}}} 1.0",
                f"vllm:num_requests_waiting{{{lab}}} 0.0",
                f'vllm:time_to_first_token_seconds_bucket{{{lab},le="0.1"}} {c["ttft_le_0_1"]}',
                f'vllm:time_to_first_token_seconds_bucket{{{lab},le="1.0"}} {c["ttft_le_1"]}',
                f'vllm:time_to_first_token_seconds_bucket{{{lab},le="+Inf"}} {c["ttft_count"]}',
                f"vllm:time_to_first_token_seconds_sum{{{lab}}} {c['ttft_sum']}",
                f"vllm:time_to_first_token_seconds_count{{{lab}}} {c['ttft_count']}",
                "",
            ]
        )

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        from tokencake.bench.replay import WARMUP_PROMPT

        if body["messages"][-1].get("content") == WARMUP_PROMPT:
            self.warmups += 1  # the runner's discarded warm-up request: not part of the workload
        else:
            self.bodies.append(body)
        prompt = sum(len(str(m.get("content") or "").split()) for m in body["messages"])
        max_tokens = int(body.get("max_tokens") or 16)
        completion = max_tokens if body.get("ignore_eos") else max(1, max_tokens // 2)
        completion = max(1, completion - self.short_by)
        hit = int(prompt * self.hit_fraction)
        c = self.c
        c["prompt"] += prompt
        c["computed"] += prompt - hit
        c["hit"] += hit
        c["gen"] += completion
        c["queries"] += prompt
        c["hits"] += hit
        c["success"] += 1
        ttft = 0.05 if self.hit_fraction > 0.5 else 0.5
        c["ttft_sum"] += ttft
        c["ttft_count"] += 1
        c["ttft_le_0_1"] += ttft <= 0.1
        c["ttft_le_1"] += 1
        for name, n in (self.stats or {}).items():
            self.ext_counters[name] = self.ext_counters.get(name, 0) + n
        text = " ".join(f"w{i}" for i in range(completion))
        return {
            "id": f"chatcmpl-{len(self.bodies)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "fake"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": hit},
            },
        }

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/metrics":
            return httpx.Response(200, text=self.metrics_text())
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake", "object": "model"}]})
        if path == "/v1/chat/completions" and request.method == "POST":
            return httpx.Response(200, json=self.chat(json.loads(request.content)))
        if path == "/v1/stats" and request.url.port == EVENTS_PORT:
            if self.stats is None:
                return httpx.Response(404)
            return httpx.Response(200, json={"counters": dict(self.ext_counters), "histograms": {}})
        if path == "/v1/events" and request.url.port == EVENTS_PORT:
            event = json.loads(request.content)
            return httpx.Response(200, json={"ok": True, "status": "recorded", "decision": event.get("type")})
        return httpx.Response(404, json={"error": f"no route {request.method} {path}"})

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)


class FakeServer:
    """Stands in for ``tokencake.serving.Server``: records its kwargs, serves a :class:`FakeVLLM`."""

    #: system name by "baseline" flag and block count -> FakeVLLM; set by the test.
    instances: ClassVar[list[FakeServer]] = []
    make_backend: Any = None

    def __init__(
        self,
        model: str | None = None,
        *,
        baseline: bool = False,
        num_gpu_blocks: int | None = None,
        host_pool_blocks: int | None = None,
        max_model_len: int = 4096,
        eager: bool = True,
        extra_args: tuple[str, ...] = (),
        log_file: str | None = None,
        extension_config: dict[str, bool] | None = None,
        scheduler_cls: str | None = None,
    ) -> None:
        self.kwargs = {
            "model": model,
            "baseline": baseline,
            "num_gpu_blocks": num_gpu_blocks,
            "host_pool_blocks": host_pool_blocks,
            "extension_config": extension_config,
            "log_file": log_file,
            "scheduler_cls": scheduler_cls,
        }
        self.backend: FakeVLLM = type(self).make_backend(self)
        self.base_url = "http://fake/v1"
        self.events_url = None if baseline else f"http://127.0.0.1:{EVENTS_PORT}"
        self.model = "fake"
        self.entered = self.exited = False
        type(self).instances.append(self)

    def __enter__(self) -> FakeServer:
        self.entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.exited = True

    def vllm_args(self) -> list[str]:
        """The provenance flags a real server's argv carries (``Server.vllm_args``)."""
        args = ["--dtype", "float32", "--num-gpu-blocks-override", str(self.kwargs["num_gpu_blocks"])]
        if not self.kwargs["baseline"]:
            args += ["--scheduling-policy", "priority"]
            extra = {"host_pool_blocks": self.kwargs["host_pool_blocks"]}
            args += ["--kv-transfer-config", json.dumps({"kv_connector_extra_config": extra})]
            if self.kwargs["scheduler_cls"]:
                args += ["--scheduler-cls", self.kwargs["scheduler_cls"]]
        return args


@pytest.fixture
def fake_vllm() -> type[FakeVLLM]:
    return FakeVLLM


@pytest.fixture
def fake_server() -> Iterator[type[FakeServer]]:
    """A fresh FakeServer subclass per test (its own instance list and backend factory)."""

    class Server(FakeServer):
        instances: list[FakeServer] = []  # noqa: RUF012
        make_backend = staticmethod(lambda server: FakeVLLM())

    yield Server


def _system(e2e_s: float, computed: float, ext: dict[str, Any] | None) -> dict[str, Any]:
    from tokencake.bench.metrics import summarize

    return {
        "apps": [{"status": "ok", "e2e_s": e2e_s, "run_id": "app-0"}],
        "client": {"e2e_s": summarize([e2e_s])},
        "server": {"computed_prompt_tokens": computed},
        "extension": {"summary": ext} if ext is not None else None,
    }


@pytest.fixture
def make_round() -> Any:
    """Builds one round's point dict as run_bench stores it, from one app E2E per system.

    ``make_round(2, baseline=20.0, tokencake=(17.0, {"ready_rate": 0.5}), ideal=15.0)``: a number is a
    stock system's E2E, a (number, summary) pair adds the extension summary.
    """
    from tokencake.bench.compare import compare

    def build(rep: int, label: str = "p", **systems: Any) -> dict[str, Any]:
        per_system = {}
        for name, value in systems.items():
            e2e, ext = value if isinstance(value, tuple) else (value, None)
            per_system[name.replace("_", "-")] = _system(e2e, 1000.0 * e2e, ext)
        return {
            "label": f"{label}#{rep}",
            "base_label": label,
            "repeat": rep,
            "systems": per_system,
            "comparison": compare(per_system),
        }

    return build


@pytest.fixture
def pooled_results(make_round: Any) -> dict[str, Any]:
    """A stored three-round run of one point (``p``) with its aggregate, as the reports read it."""
    from tokencake.bench.rounds import aggregate

    ext = [{"next_turn_recomputed_share": s, "ready_rate": 0.5} for s in (0.2, 0.3, 0.4)]
    points = [
        make_round(i + 1, baseline=20.0, tokencake=(tc_, ext[i]), ideal=15.0, tokencake_roomy=15.3 + 0.3 * i)
        for i, tc_ in enumerate((16.0, 18.0, 17.0))
    ]
    for p in points:
        p["equal_work"] = {"passed": True, "calls_compared": 4}
    return {
        "preset": "stress",
        "valid": True,
        "wall_s": 1.0,
        "warnings": [],
        "points": points,
        "system_orders": [
            {"round": i + 1, "point": "p", "order": o}
            for i, o in enumerate(
                [["ideal", "baseline", "tokencake", "tokencake-roomy"]] * 2
                + [["tokencake", "ideal", "tokencake-roomy", "baseline"]]
            )
        ],
        "aggregate": aggregate(points),
    }
