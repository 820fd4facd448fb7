"""The synthetic ``multi_turn`` app: agents with long private contexts, several turns, tool calls between.

This is the shape where KV handling around tool calls matters most (see the headroom table in the
research digest): each agent carries a ~1,000-token context that shares no prefix with any other
agent, asks the model a question, waits for a tool (seconds), then continues the *same* conversation.
On a small device KV cache, stock vLLM evicts the idle agent's blocks while its tool runs and has to
recompute the whole context at the next turn; an offload/prefetch extension can bring it back instead.

Everything is derived from a seed: the context text, the questions, the tool results and the tool
durations, so every system in a benchmark sees byte-identical prompts and identical stall lengths.
The results say that this app is synthetic (``DESCRIPTION``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

DESCRIPTION = (
    "multi_turn (synthetic, seeded): each agent has a private ~context_tokens-token document, then does "
    "`turns` LLM calls on one growing conversation with a tool call (a seeded sleep) between turns."
)

# Plain English words: SmolLM2's tokenizer encodes most of them as one token (plus a space).
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which are be an or had "
    "not were but have one all their there been has would when who will more no if out so said what up "
    "its about into than them can only other new some could time these two may then do first any my now "
    "such like our over man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take three "
    "river stone market garden engine signal harbor winter copper lantern orbit ledger canyon meadow "
    "archive valve circuit tunnel glacier beacon forest quartz pilot cargo fabric thunder island "
    "compass falcon timber velvet marble rocket saddle violin walnut anchor bridge candle desert "
    "ember feather granite hammer ivory jungle kettle ladder magnet needle oyster pepper quiver "
    "ribbon silver tractor umbrella vessel whistle yarn zephyr"
).split()

_TOOL_VERBS = ("lookup", "measure", "inspect", "compare", "verify", "estimate")


@dataclass(frozen=True)
class MultiTurnSpec:
    """Knobs of the synthetic app; ``seed`` makes every byte and every duration reproducible."""

    agents: int = 1
    turns: int = 3
    context_tokens: int = 1000
    #: Output tokens per turn (forced with ignore_eos by the benchmark, so it is exact).
    max_tokens: int = 24
    #: Tool duration range in seconds (uniform draw per call, seeded), at latency scale 1.
    tool_s: tuple[float, float] = (3.0, 3.0)
    #: Approximate tokens of each tool result appended to the conversation.
    tool_result_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.agents < 1 or self.turns < 1:
            raise ValueError("multi_turn needs agents >= 1 and turns >= 1")
        if self.context_tokens < 1 or self.max_tokens < 1:
            raise ValueError("multi_turn needs context_tokens >= 1 and max_tokens >= 1")
        lo, hi = self.tool_s
        if lo < 0 or hi < lo:
            raise ValueError(f"tool_s must be (low, high) with 0 <= low <= high, got {self.tool_s!r}")

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> MultiTurnSpec:
        known = {k: v for k, v in params.items() if k in cls.__dataclass_fields__}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ValueError(f"multi_turn: unknown parameter(s) {', '.join(unknown)}")
        if "tool_s" in known:
            value = known["tool_s"]
            known["tool_s"] = (float(value), float(value)) if isinstance(value, int | float) else tuple(value)
        return cls(**known)


def words(rng: random.Random, n: int) -> str:
    """``n`` seeded plain words (about ``n`` tokens: most are one token each), for both synthetic apps."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def document(spec: MultiTurnSpec, agent: int) -> str:
    """The agent's private context (about ``context_tokens`` tokens; each word is ~1 token)."""
    rng = random.Random(f"multi_turn-doc:{spec.seed}:{agent}")
    # A unique header first: two agents never share even a single full KV block of prefix.
    header = f"Case file {spec.seed}-{agent}-{rng.randrange(10**9)}."
    sentences = []
    remaining = spec.context_tokens
    while remaining > 0:
        n = min(remaining, rng.randint(8, 16))
        sentences.append(words(rng, n).capitalize() + ".")
        remaining -= n + 1
    return header + " " + " ".join(sentences)


def tool_durations(spec: MultiTurnSpec, scale: float = 1.0) -> list[list[float]]:
    """Seconds of each tool call, ``[agent][turn]`` (``turns - 1`` calls per agent)."""
    rng = random.Random(f"multi_turn-tools:{spec.seed}")
    lo, hi = spec.tool_s
    return [
        [round(rng.uniform(lo, hi) * scale, 4) for _ in range(spec.turns - 1)] for _ in range(spec.agents)
    ]


def tool_result(spec: MultiTurnSpec, agent: int, turn: int) -> str:
    rng = random.Random(f"multi_turn-result:{spec.seed}:{agent}:{turn}")
    return f"result {turn}: " + words(rng, spec.tool_result_tokens)


def question(agent: int, turn: int) -> str:
    verb = _TOOL_VERBS[(agent + turn) % len(_TOOL_VERBS)]
    if turn == 0:
        return f"Read the case file above. Which item should we {verb} first? Answer briefly."
    return f"The tool returned the result above. What should we {verb} next? Answer briefly."


def build_app(spec: MultiTurnSpec, *, latency_scale: float = 1.0, name: str = "multi_turn") -> Any:
    """Build the app with the SDK (``tokencake.App``); run it with no inputs."""
    import anyio

    import tokencake as tc

    app = tc.App(name, inputs=[], description=DESCRIPTION)
    durations = tool_durations(spec, latency_scale)
    lo, hi = spec.tool_s
    predicted = (lo + hi) / 2 * latency_scale

    async def lookup(agent: int, turn: int) -> str:
        """Fetch the next piece of evidence (a seeded sleep standing in for a slow tool).

        Args:
            agent: which agent asks.
            turn: which turn of that agent.
        """
        await anyio.sleep(durations[agent][turn])
        return tool_result(spec, agent, turn)

    app.add_tool(lookup, name="lookup", predict_time=predicted, kind="search")

    def make_agent(agent: int):
        async def run_agent(ctx: Any, inputs: dict[str, object]) -> str:
            reply = await ctx.llm(question(agent, 0))
            for turn in range(1, spec.turns):
                result = await ctx.call("lookup", agent=agent, turn=turn - 1)
                reply = await ctx.llm(f"{result}\n{question(agent, turn)}")
            return reply.text

        return run_agent

    for agent in range(spec.agents):
        app.add_agent(
            make_agent(agent),
            name=f"agent_{agent}",
            system=document(spec, agent),
            max_tokens=spec.max_tokens,
            temperature=0.0,
            calls=["lookup"] if spec.turns > 1 else [],
        )
    return app
