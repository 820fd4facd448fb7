"""Traces of the bench presets: rebuilt from a stored bench run, or generated at any scale.

``from_bench_point`` rebuilds what a ``tokencake bench`` point replayed — the same seeded apps
(``multi_turn`` for ci/headroom, ``agent_mix`` for stress: node structure, start delays, tool
hints and tool durations come from the apps' own seeded plans) with the prompt and output tokens
the server counted for every call. ``generate`` makes the same shapes at any size from the specs
alone (token counts estimated: a synthetic word is ~1.07 tokens, and each turn appends the reply,
the tool result and the next question, ~48 tokens besides the reply, as measured on SmolLM2's
tokenizer in the stored runs).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from tokencake.bench import agent_mix
from tokencake.bench.synthetic import MultiTurnSpec
from tokencake.bench.synthetic import tool_durations as multi_turn_durations
from tokencake.sim.trace import (
    AppTrace,
    DelayStep,
    LLMStep,
    NodeTrace,
    Step,
    ToolStep,
    Trace,
    with_priorities,
)

__all__ = ["PRESETS", "from_bench_point", "generate"]

#: Tokens per synthetic word (measured: 1,000-word contexts gave 1,061–1,086-token first prompts).
TOKENS_PER_WORD = 1.07
#: Tokens a turn appends besides the reply (tool result + next question + chat template).
TURN_OVERHEAD_TOKENS = 48
#: Tokens of the join agent's prompt per worker report (measured: 156 tokens for 4 workers).
JOIN_TOKENS_PER_WORKER = 30

PRESETS = ("ci", "headroom", "stress")
#: ``generate("stress", agents=N)`` splits the N workers into fan-in apps of at most this many.
WORKERS_PER_APP = 8


def _scale(latency: str) -> float:
    return float(latency.split(":", 1)[1]) if latency.startswith("scaled:") else 1.0


def from_bench_point(point: Mapping[str, Any], calls_from: str = "baseline") -> Trace:
    """The trace of one stored bench point (``results.json`` → ``points[i]``), tokens from ``calls_from``."""
    workload = point["workload"]
    scale = _scale(str(workload.get("latency", "paper")))
    system = point["systems"][calls_from]
    calls: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    for c in sorted(system["calls"], key=lambda c: c["started"]):
        if c.get("status") == 200:
            calls[(c["run_id"], c["node"])].append((int(c["prompt_tokens"]), int(c["completion_tokens"])))
    open_loop = workload.get("arrival") != "concurrent"
    recorded = {a["run_id"]: float(a["arrival_s"]) for a in system["apps"]}
    apps = []
    for arrival in workload["arrivals"]:
        run_id = arrival["run_id"]
        at = float(arrival["at_s"]) if open_loop else recorded.get(run_id, 0.0)
        nodes = _nodes(arrival["app"], arrival["params"], scale, tokens=lambda n, r=run_id: calls[(r, n)])
        apps.append(with_priorities(AppTrace(run_id, round(at, 6), nodes)))
    return Trace(tuple(apps), {"source": f"bench point {point.get('label')}", "calls_from": calls_from})


def generate(
    preset: str,
    *,
    agents: int | None = None,
    turns: int | None = None,
    context_tokens: int | None = None,
    apps: int | None = None,
    rate: float | None = None,
    output_tokens: int = 24,
    shared_prefix_tokens: int = 0,
    seed: int = 0,
    mix: Mapping[str, Any] | None = None,
) -> Trace:
    """A synthetic trace shaped like ``preset`` at any size.

    ``ci`` / ``headroom``: ``agents`` one-agent multi-turn apps (default 6), all at once, ``turns``
    calls each. ``stress``: ``agents`` workers in total (default 4), in fan-in apps of at most
    ``WORKERS_PER_APP`` workers + a join (or ``apps`` apps sharing them), arriving as a Poisson
    process at ``rate`` apps/s (default 0.25); ``turns`` fixes each worker's call count (default
    3–5). Contexts default to the preset's (1,000 / 1,200 tokens). ``mix`` (stress only) overrides
    any other :class:`~tokencake.bench.agent_mix.AgentMixSpec` knob of every app — tool-time median,
    shape and cap, the wrong hint's error, the stagger, a turn range — so a sweep can draw
    workloads unlike the preset's.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if mix and preset != "stress":
        raise ValueError("mix overrides apply to the stress preset's agent_mix apps only")
    fixed = {"workers", "seed", "context_tokens", "shared_prefix_tokens", "max_tokens"} & set(mix or ())
    if fixed:
        raise ValueError(f"mix cannot override {', '.join(sorted(fixed))}: use generate()'s own arguments")
    for name, value in (
        ("agents", agents),
        ("turns", turns),
        ("context_tokens", context_tokens),
        ("apps", apps),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    out = []
    if preset in ("ci", "headroom"):
        base = {"ci": (3, 1000, (3.5, 4.5)), "headroom": (6, 1000, (3.0, 3.0))}[preset]
        for i in range(agents or apps or 6):
            params = {
                "turns": turns or base[0],
                "context_tokens": context_tokens or base[1],
                "max_tokens": output_tokens,
                "tool_s": list(base[2]),
                "seed": seed + i,
            }
            out.append(
                with_priorities(
                    AppTrace(f"{preset}-{i:05d}", 0.0, _nodes("multi_turn", params, 1.0, tokens=None))
                )
            )
    else:
        total = agents or 4
        n_apps = apps or -(-total // WORKERS_PER_APP)
        rng = random.Random(f"sim-arrivals:{seed}")
        t = 0.0
        for i in range(n_apps):
            workers = total // n_apps + (1 if i < total % n_apps else 0)
            if workers < 1:
                break
            params = {
                "workers": workers,
                "turns": [turns, turns] if turns else [3, 5],
                "context_tokens": context_tokens or 1200,
                "shared_prefix_tokens": shared_prefix_tokens,
                "max_tokens": output_tokens,
                "seed": seed + i,
                **(mix or {}),
            }
            out.append(
                with_priorities(
                    AppTrace(f"stress-{i:05d}", round(t, 6), _nodes("agent_mix", params, 1.0, tokens=None))
                )
            )
            t += rng.expovariate(rate or 0.25)
    return Trace(tuple(out), {"source": f"generated {preset}", "seed": seed})


def _grow(first: int, turns: int, output: int, recorded: list[tuple[int, int]] | None) -> list[LLMStep]:
    if recorded:
        return [LLMStep(p, o) for p, o in recorded]
    steps, prompt = [], first
    for _ in range(turns):
        steps.append(LLMStep(prompt, output))
        prompt += output + TURN_OVERHEAD_TOKENS
    return steps


def _nodes(app: str, params: Mapping[str, Any], scale: float, tokens: Any) -> tuple[NodeTrace, ...]:
    if app == "multi_turn":
        spec = MultiTurnSpec.from_params(dict(params))
        durations = multi_turn_durations(spec, scale)
        hint = (spec.tool_s[0] + spec.tool_s[1]) / 2 * scale
        nodes = []
        for a in range(spec.agents):
            name = f"agent_{a}"
            llm = _grow(
                round(spec.context_tokens * TOKENS_PER_WORD) + 20,
                spec.turns,
                spec.max_tokens,
                tokens(name) if tokens else None,
            )
            steps: list[Step] = []
            for t, call in enumerate(llm):
                steps.append(call)
                if t < len(llm) - 1:
                    steps.append(ToolStep("lookup", hint, durations[a][t]))
            nodes.append(NodeTrace(name, tuple(steps), "agent"))
        return tuple(nodes)
    if app == "agent_mix":
        spec = agent_mix.AgentMixSpec.from_params(dict(params))
        plan = agent_mix.plan(spec, scale)
        durations = agent_mix.tool_durations(spec, scale)
        hints = agent_mix.hints(spec, scale)
        shared = spec.shared_prefix_tokens
        nodes = []
        for w in plan:
            name = f"worker_{w.index}"
            first = round((shared + w.private_tokens) * TOKENS_PER_WORD) + 20
            llm = _grow(first, w.turns, spec.max_tokens, tokens(name) if tokens else None)
            steps = [DelayStep(w.start_s)] if w.start_s > 0 else []
            for s, call in enumerate(llm):
                steps.append(call)
                if s < len(llm) - 1:
                    tool = agent_mix.tool_for(w.index, s)
                    steps.append(ToolStep(tool, hints[tool], durations[w.index][s]))
            nodes.append(
                NodeTrace(
                    name,
                    tuple(steps),
                    agent_mix.WORKER_TYPE,
                    (),
                    "agent_mix-preamble" if shared else None,
                    round(shared * TOKENS_PER_WORD),
                )
            )
        join = _grow(
            JOIN_TOKENS_PER_WORKER * len(plan) + 36, 1, spec.max_tokens, tokens("join") if tokens else None
        )
        nodes.append(
            NodeTrace("join", tuple(join), agent_mix.JOIN_TYPE, tuple(f"worker_{w.index}" for w in plan))
        )
        return tuple(nodes)
    raise ValueError(f"no trace model for app {app!r} (only the synthetic bench apps multi_turn, agent_mix)")
