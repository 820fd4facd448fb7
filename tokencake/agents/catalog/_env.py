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
import re
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokencake.agents.catalog._corpus import Corpus, bundled_corpus
from tokencake.agents.catalog._latency import LatencyModel
from tokencake.agents.catalog._sandbox import Sandbox

_CURRENT: contextvars.ContextVar[RunState | None] = contextvars.ContextVar(
    "tokencake_catalog_run", default=None
)
#: Per-run states kept at most (oldest dropped; their sandbox directories stay on disk).
MAX_RUNS = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass
class RunState:
    """One run's private things: its sandbox and a scratch dict for tools."""

    run_id: str
    sandbox: Sandbox
    data: dict[str, Any] = field(default_factory=dict)


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
    ) -> None:
        self.app_name = app_name
        self.latency = LatencyModel.parse(latency, noise=noise, seed=seed)
        self.seed = seed
        self.workdir = Path(workdir) if workdir is not None else None
        self._corpus = corpus
        self._runs: OrderedDict[str, RunState] = OrderedDict()
        self._lock = threading.Lock()

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
                    sandbox = Sandbox(self.workdir / f"{self.app_name}-{safe}")
                else:
                    sandbox = Sandbox(prefix=f"tokencake-{self.app_name}-{safe}-")
                state = RunState(run_id, sandbox)
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

    def pace(self, tool: str, published_s: float) -> AbstractAsyncContextManager[None]:
        """Latency padding for one tool call (see :class:`LatencyModel`)."""
        return self.latency.pace(tool, published_s)


__all__ = ["MAX_RUNS", "AppEnv", "RunState"]
