"""What a catalog app's nodes and tools share: the latency model, the corpus and per-run sandboxes.

An app object is built once and may run many times, possibly concurrently, but tool functions are
registered once and only receive their (model-chosen) arguments. Each node body therefore binds
the run's :class:`RunState` to a context variable (:meth:`AppEnv.node`); the tools it calls —
directly or through the model-driven tool loop — run in the node's task or in tasks/threads that
copy its context, so :meth:`AppEnv.current` finds the right sandbox without a global.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import re
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import tokencake as tc
from tokencake.agents.catalog._corpus import Corpus, bundled_corpus
from tokencake.agents.catalog._latency import LatencyModel
from tokencake.agents.catalog._material import parse_level
from tokencake.agents.catalog._sandbox import Sandbox

if TYPE_CHECKING:
    from typing_extensions import Unpack

_CURRENT: contextvars.ContextVar[RunState | None] = contextvars.ContextVar(
    "tokencake_catalog_run", default=None
)
#: Per-run states kept at most (oldest dropped; their sandbox directories stay on disk).
MAX_RUNS = 64
#: Sampling of every catalog agent: greedy (reproducible, and comparable between servers), with a
#: mild repetition penalty — without it the bundled 135M model repeats the same paragraph until its
#: token budget runs out. vLLM takes ``repetition_penalty`` as an extra request field; servers that
#: do not know it ignore it or reject it, so a user's own server can drop it (``AppEnv.sampling``).
SAMPLING: dict[str, Any] = {"temperature": 0.0, "extra_body": {"repetition_penalty": 1.15}}
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass
class RunState:
    """One run's private things: its sandbox (created on first use) and a scratch dict for tools."""

    run_id: str
    make_sandbox: Callable[[], Sandbox] = field(repr=False)
    data: dict[str, Any] = field(default_factory=dict)
    _sandbox: Sandbox | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def sandbox(self) -> Sandbox:
        # Lazily: apps that never touch files (deep-research, rag, ...) leave no directory behind.
        with self._lock:
            if self._sandbox is None:
                self._sandbox = self.make_sandbox()
            return self._sandbox


class AppEnv:
    """Shared state of one catalog app object (see the module docstring)."""

    def __init__(
        self,
        app_name: str,
        *,
        latency: str | LatencyModel | None = "real",
        seed: int | None = None,
        noise: float = 0.0,
        workdir: str | Path | None = None,
        corpus: Corpus | None = None,
        token_scale: float = 1.0,
        context: str = "realistic",
    ) -> None:
        if not isinstance(token_scale, int | float) or not 0 < token_scale <= 4:
            raise ValueError(f"token_scale must be a number in (0, 4], got {token_scale!r}")
        self.app_name = app_name
        self.token_scale = float(token_scale)
        self.latency = LatencyModel.parse(latency, noise=noise, seed=seed)
        self.seed = seed
        #: ``small`` | ``realistic``: how much tool output agents carry (see ``_material``).
        self.context = parse_level(context)
        self.workdir = Path(workdir) if workdir is not None else None
        self._corpus = corpus
        self._runs: OrderedDict[str, RunState] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def sampling(self) -> dict[str, Any]:
        """The agent options catalog agents that write prose are declared with (``**env.sampling``)."""
        return {"temperature": SAMPLING["temperature"], "extra_body": dict(SAMPLING["extra_body"])}

    @property
    def tool_sampling(self) -> dict[str, Any]:
        """Agents whose replies are mostly tool calls: greedy only (a repetition penalty would
        penalise the JSON keys and quotes every call repeats)."""
        return {"temperature": SAMPLING["temperature"]}

    @property
    def corpus(self) -> Corpus:
        if self._corpus is None:
            self._corpus = bundled_corpus()
        return self._corpus

    def run_state(self, run_id: str) -> RunState:
        """The state of ``run_id``, created (with a fresh sandbox) on first use."""
        with self._lock:
            state = self._runs.get(run_id)
            if state is None:
                safe = _UNSAFE.sub("-", run_id)[:80] or "run"
                if self.workdir is not None:
                    root = self.workdir / f"{self.app_name}-{safe}"
                    state = RunState(run_id, lambda: Sandbox(root))
                else:
                    prefix = f"tokencake-{self.app_name}-{safe}-"
                    state = RunState(run_id, lambda: Sandbox(prefix=prefix))
                self._runs[run_id] = state
                while len(self._runs) > MAX_RUNS:
                    self._runs.popitem(last=False)
            return state

    def current(self) -> RunState:
        """The state bound by the calling node, or a shared ``direct`` state for direct tool calls."""
        state = _CURRENT.get()
        return state if state is not None else self.run_state("direct")

    @contextmanager
    def bind(self, run_id: str) -> Any:
        token = _CURRENT.set(self.run_state(run_id))
        try:
            yield
        finally:
            _CURRENT.reset(token)

    def node(self, fn: Callable[[Any, dict[str, Any]], Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """Wrap a node body so that its tools see this run's state."""

        @functools.wraps(fn)
        async def bound(ctx: Any, inputs: dict[str, Any]) -> Any:
            with self.bind(ctx.run_id):
                return await fn(ctx, inputs)

        return bound

    def tokens(self, budget: int) -> int:
        """A node's output-token budget scaled by ``token_scale`` (never below 8)."""
        return max(8, round(budget * self.token_scale))

    def size(self, table: dict[str, int]) -> int:
        """This app's entry of a ``{level: tokens}`` size table."""
        return table[self.context]

    def keep(self, node: str, messages: list[dict[str, Any]]) -> None:
        """Store a node's conversation so the next node of the same agent can continue it."""
        self.current().data[f"conversation:{node}"] = [dict(m) for m in messages]

    def history(self, node: str) -> list[dict[str, Any]]:
        """The conversation :meth:`keep` stored for ``node``, without its system message.

        A node with the same system prompt that sends ``[*history, new_message]`` repeats the
        earlier node's prompt token for token: the agent's KV from before its tool call is the
        prefix of its next request (what a server should keep, or bring back, during the stall).
        """
        messages = self.current().data.get(f"conversation:{node}", [])
        return [dict(m) for m in messages if m.get("role") != "system"]

    def pace(self, tool: str, published_s: float) -> AbstractAsyncContextManager[None]:
        """Latency padding for one tool call (see :class:`LatencyModel`)."""
        return self.latency.pace(tool, published_s)


__all__ = ["MAX_RUNS", "AppEnv", "RunState"]


class EnvOptions(TypedDict, total=False):
    """The build parameters every catalog app takes (see ``tokencake.agents.catalog``)."""

    latency: str | LatencyModel | None
    seed: int | None
    noise: float
    workdir: str | Path | None
    token_scale: float
    context: str


#: Their defaults, as ``AppEnv`` has them (``build_params`` lists them before an app's own).
ENV_DEFAULTS: dict[str, Any] = {
    name: p.default
    for name, p in inspect.signature(AppEnv).parameters.items()
    if name in EnvOptions.__annotations__
}


def new_app(name: str, description: str, **options: Unpack[EnvOptions]) -> tuple[AppEnv, tc.App]:
    """What every catalog ``build`` starts with: the app's shared state and its empty App."""
    return AppEnv(name, **options), tc.App(name, inputs=["task"], description=description)
