"""The synthetic ``agent_mix`` app: K multi-turn workers fan in to one join agent (the ``stress`` preset).

It is built to be *unlike* the ``multi_turn`` app the KV policy was calibrated on (``ci``/``headroom``),
so a result on it says something about workloads the policy has not seen:

* **fan-in DAG** — ``workers`` worker agents, each with its own tool loop on one growing conversation,
  feed one ``join`` agent that makes a single short LLM call over the workers' last replies;
* **heterogeneous contexts** — each worker's private document is 0.5–1.5 × ``context_tokens`` long
  (seeded; one word ≈ one token, as in :mod:`tokencake.bench.synthetic`);
* **heterogeneous turn counts** — each worker does ``turns[0]``–``turns[1]`` LLM calls (seeded);
* **heavy-tailed tool times** — every tool call sleeps a lognormal time with median ``tool_median_s``
  and shape ``tool_sigma`` (capped at ``tool_cap`` × the median so one draw cannot stall a run). The
  ``lookup`` tool's ``predict_time`` hint is the median; the ``crawl`` tool has the same distribution
  but a hint ``hint_error`` × too small. Workers alternate between the two, so the extension's
  per-(agent type, tool) forecaster sees both a right and a wrong hint;
* **staggered starts** — worker *i* sleeps ``i × stagger_s`` before its first LLM call (no KV yet, so
  this is not a stall); a ``scaled:X`` latency mode scales these delays with the tool times;
* **shared prefix** (``shared_prefix_tokens > 0``) — every worker's system prompt starts with the same
  preamble (identical in every app of the workload, like a fixed app prompt), then its private part.

Everything is derived from ``seed`` (documents, turn counts, tool durations, tool results), so every
system replays byte-identical prompts and identical stall lengths; ``DESCRIPTION`` goes into the results.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from tokencake.bench.synthetic import words

DESCRIPTION = (
    "agent_mix (synthetic, seeded): `workers` multi-turn worker agents fan in to one join agent; "
    "private documents 0.5-1.5 x context_tokens, 3-5 turns per worker, lognormal tool times "
    "(median tool_median_s, sigma tool_sigma) over two tools, `lookup` (hint = median) and `crawl` "
    "(hint = median / hint_error); worker i starts i x stagger_s late; with shared_prefix_tokens > 0 "
    "every worker's system prompt opens with the same preamble."
)

#: The two tools, in the order workers alternate between them: (name, kind).
TOOLS: tuple[tuple[str, str], ...] = (("lookup", "search"), ("crawl", "fetch"))
#: Relative spread of the private document lengths around ``context_tokens``.
CONTEXT_SPREAD = (0.5, 1.5)
#: Agent types the extension's forecaster keys its history by.
WORKER_TYPE, JOIN_TYPE = "worker", "join"
_VERBS = ("trace", "weigh", "check", "rank", "map", "test")


@dataclass(frozen=True)
class AgentMixSpec:
    """Knobs of the app; ``seed`` makes every byte and every duration reproducible."""

    workers: int = 3
    #: Inclusive range of LLM calls per worker (seeded draw per worker).
    turns: tuple[int, int] = (3, 5)
    #: Base length of a worker's private document; each draws 0.5-1.5 x this (seeded).
    context_tokens: int = 1200
    #: Length of the preamble every worker's system prompt starts with (0 = no shared prefix).
    shared_prefix_tokens: int = 0
    #: Output tokens per LLM call (forced with ignore_eos by the benchmark, so it is exact).
    max_tokens: int = 24
    tool_median_s: float = 3.0
    tool_sigma: float = 0.6
    #: Longest tool call, as a multiple of the median (about the 99th percentile at sigma 0.6).
    tool_cap: float = 4.0
    #: ``crawl``'s hint is its median divided by this (the wrong hint).
    hint_error: float = 2.0
    #: Seconds between the starts of consecutive workers.
    stagger_s: float = 0.8
    #: Approximate tokens of each tool result appended to the conversation.
    tool_result_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        lo, hi = self.turns
        problems = []
        if self.workers < 1:
            problems.append("workers >= 1")
        if not 1 <= lo <= hi:
            problems.append(f"turns (low, high) with 1 <= low <= high, got {self.turns!r}")
        if self.context_tokens < 2 or self.max_tokens < 1 or self.shared_prefix_tokens < 0:
            problems.append("context_tokens >= 2, max_tokens >= 1, shared_prefix_tokens >= 0")
        if self.tool_median_s < 0 or self.tool_sigma < 0 or self.tool_cap < 1 or self.hint_error <= 0:
            problems.append("tool_median_s >= 0, tool_sigma >= 0, tool_cap >= 1, hint_error > 0")
        if self.stagger_s < 0:
            problems.append("stagger_s >= 0")
        if problems:
            raise ValueError("agent_mix needs " + "; ".join(problems))

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> AgentMixSpec:
        """Build from workload parameters (JSON: tuples arrive as lists; unknown keys are an error)."""
        known = {k: v for k, v in params.items() if k in cls.__dataclass_fields__}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ValueError(f"agent_mix: unknown parameter(s) {', '.join(unknown)}")
        if "turns" in known:
            value = known["turns"]
            known["turns"] = (int(value), int(value)) if isinstance(value, int) else tuple(value)
        return cls(**known)


@dataclass(frozen=True)
class WorkerPlan:
    """What one worker does: its seeded shape, fixed before the app runs."""

    index: int
    turns: int
    #: Length of its private document (words ≈ tokens).
    private_tokens: int
    #: Seconds after the worker node starts before its first LLM call.
    start_s: float


def plan(spec: AgentMixSpec, scale: float = 1.0) -> list[WorkerPlan]:
    """Every worker's turn count, private-document length and start delay (× the latency ``scale``)."""
    rng = random.Random(f"agent_mix-shape:{spec.seed}")
    lo, hi = CONTEXT_SPREAD
    out = []
    for i in range(spec.workers):
        turns = rng.randint(*spec.turns)
        private = max(1, round(spec.context_tokens * rng.uniform(lo, hi)))
        out.append(WorkerPlan(i, turns, private, round(i * spec.stagger_s * scale, 6)))
    return out


def tool_for(worker: int, stall: int) -> str:
    """The tool a worker calls at its ``stall``-th tool call: alternating, so both are used."""
    return TOOLS[(worker + stall) % len(TOOLS)][0]


def hints(spec: AgentMixSpec, scale: float = 1.0) -> dict[str, float]:
    """Each tool's ``predict_time``: the median for ``lookup``, median / ``hint_error`` for ``crawl``."""
    median = spec.tool_median_s * scale
    return {"lookup": median, "crawl": median / spec.hint_error}


def tool_durations(spec: AgentMixSpec, scale: float = 1.0) -> list[list[float]]:
    """Seconds of each tool call, ``[worker][stall]`` (``turns - 1`` calls per worker): lognormal draws."""
    rng = random.Random(f"agent_mix-tools:{spec.seed}")
    median = spec.tool_median_s
    mu = math.log(median) if median > 0 else 0.0
    cap = spec.tool_cap * median
    out = []
    for worker in plan(spec):
        row = []
        for _ in range(worker.turns - 1):
            draw = rng.lognormvariate(mu, spec.tool_sigma) if median > 0 else 0.0
            row.append(round(min(draw, cap) * scale, 4))
        out.append(row)
    return out


def preamble(spec: AgentMixSpec) -> str:
    """The common opening of every worker's system prompt ('' without a shared prefix).

    It depends on ``shared_prefix_tokens`` only, not on the seed: every worker of every app of the
    workload starts with the same bytes, as apps sharing one fixed instruction prompt do.
    """
    if spec.shared_prefix_tokens <= 0:
        return ""
    rng = random.Random("agent_mix-preamble")
    return "Team handbook. " + _sentences(rng, spec.shared_prefix_tokens)


def private_document(spec: AgentMixSpec, worker: WorkerPlan) -> str:
    """The worker's own document; its unique header keeps it from sharing a block with any other."""
    rng = random.Random(f"agent_mix-doc:{spec.seed}:{worker.index}")
    header = f"Worker file {spec.seed}-{worker.index}-{rng.randrange(10**9)}."
    return header + " " + _sentences(rng, worker.private_tokens)


def system_prompt(spec: AgentMixSpec, worker: WorkerPlan) -> str:
    """Preamble (when shared) + private document."""
    shared = preamble(spec)
    private = private_document(spec, worker)
    return f"{shared}\n\n{private}" if shared else private


def _sentences(rng: random.Random, tokens: int) -> str:
    sentences = []
    remaining = tokens
    while remaining > 0:
        n = min(remaining, rng.randint(8, 16))
        sentences.append(words(rng, n).capitalize() + ".")
        remaining -= n + 1
    return " ".join(sentences)


def tool_result(spec: AgentMixSpec, worker: int, stall: int) -> str:
    rng = random.Random(f"agent_mix-result:{spec.seed}:{worker}:{stall}")
    return f"{tool_for(worker, stall)} result {stall}: " + words(rng, spec.tool_result_tokens)


def question(worker: int, turn: int) -> str:
    verb = _VERBS[(worker + turn) % len(_VERBS)]
    if turn == 0:
        return f"Read your file above. What should we {verb} first? Answer briefly."
    return f"The tool returned the result above. What should we {verb} next? Answer briefly."


def join_prompt(replies: list[str]) -> str:
    notes = "\n".join(f"- worker {i}: {r.strip()}" for i, r in enumerate(replies))
    return f"Worker reports:\n{notes}\nSummarise the reports in one sentence."


JOIN_SYSTEM = "You combine short reports from several workers into one sentence."


def build_app(spec: AgentMixSpec, *, latency_scale: float = 1.0, name: str = "agent_mix") -> Any:
    """Build the app with the SDK (``tokencake.App``); run it with no inputs."""
    import anyio

    import tokencake as tc

    app = tc.App(name, inputs=[], description=DESCRIPTION)
    workers = plan(spec, latency_scale)
    durations = tool_durations(spec, latency_scale)
    predicted = hints(spec, latency_scale)

    def make_tool():
        async def tool(worker: int, stall: int) -> str:
            """Fetch the next piece of evidence (a seeded lognormal sleep standing in for a slow tool).

            Args:
                worker: which worker asks.
                stall: which tool call of that worker.
            """
            await anyio.sleep(durations[worker][stall])
            return tool_result(spec, worker, stall)

        return tool

    for tool_name, kind in TOOLS:
        app.add_tool(make_tool(), name=tool_name, predict_time=predicted[tool_name], kind=kind)

    def make_worker(worker: WorkerPlan):
        async def run_worker(ctx: Any, inputs: dict[str, object]) -> str:
            if worker.start_s > 0:
                await anyio.sleep(worker.start_s)
            reply = await ctx.llm(question(worker.index, 0))
            for turn in range(1, worker.turns):
                stall = turn - 1
                result = await ctx.call(tool_for(worker.index, stall), worker=worker.index, stall=stall)
                reply = await ctx.llm(f"{result}\n{question(worker.index, turn)}")
            return reply.text

        return run_worker

    names = []
    for worker in workers:
        name_i = f"worker_{worker.index}"
        names.append(name_i)
        app.add_agent(
            make_worker(worker),
            name=name_i,
            system=system_prompt(spec, worker),
            max_tokens=spec.max_tokens,
            temperature=0.0,
            calls=[tool_for(worker.index, s) for s in range(worker.turns - 1)],
            agent_type=WORKER_TYPE,
            description="a worker with its own tool loop",
        )

    async def join(ctx: Any, inputs: dict[str, Any]) -> str:
        return (await ctx.llm(join_prompt([str(inputs[n]) for n in names]))).text

    app.add_agent(
        join,
        name="join",
        system=JOIN_SYSTEM,
        max_tokens=spec.max_tokens,
        temperature=0.0,
        after=names,
        agent_type=JOIN_TYPE,
        description="one short call over the workers' last replies",
    )
    return app
