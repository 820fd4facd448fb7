"""What a KV policy sees and what it may decide, for one idle agent session.

The scheduler-side connector (``tokencake/serving/vllm/scheduler_side.py``) asks the policy at two
moments: when a request finishes (``on_finished``; ``announced`` says whether the request declared
its next tool call) and while a stall lasts (``on_stall``, at ``stall_begin`` and again whenever
the last answer was a retryable no). It carries the answer out on vLLM's block pool:

``offload``  copy the session's device blocks to the host pool; ``prefetch`` says when they come
             back (``predictive``: before the tool returns; ``at_end``: when it returns; ``none``:
             only when the next request misses on device, a demand load); ``evict_first`` puts the
             device copies first in vLLM's eviction queue once the host copy is confirmed.
``keep``     hold the session's device blocks (a reference vLLM cannot evict) for ``keep_s`` seconds,
             until the session's next request is admitted, or until the engine cannot make progress
             without them (then the latest return yields first, critical-path sessions' last).
``discard``  nothing is copied; the idle device blocks go first in the eviction queue.
``none``     nothing: vLLM's LRU decides.

A policy never imports vLLM or torch: the same objects run under the simulator and in unit tests.
Observers (``observe_*``) feed outcomes back; the defaults ignore them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from tokencake.serving.gate import GateInput

Action = Literal["offload", "keep", "discard", "none"]
PrefetchMode = Literal["predictive", "at_end", "none"]

__all__ = ["Action", "EventPolicy", "KVPolicy", "Plan", "PolicyView", "PrefetchMode"]


@dataclass(frozen=True)
class PolicyView:
    """One session at one decision point, as the engine sees it right now."""

    #: The offload gate's inputs (forecast, chain size, eviction risk, queue, host room, elapsed).
    gate: GateInput
    session_id: str = ""
    agent_type: str = ""
    #: The tool the session waits for (None when unknown: a request finished without announcing one).
    tool: str | None = None
    #: Device KV size and free blocks (vLLM's count: idle cached blocks are free).
    device_blocks: int = 0
    device_free_blocks: int = 0
    #: Blocks the requests waiting for admission need.
    waiting_blocks: int = 0
    #: Estimated seconds to recompute the chain (prefill profile) and to copy it each way.
    recompute_s: float = 0.0
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    #: Mean seconds a request waited for admission recently (queueing delay).
    queue_delay_s: float = 0.0
    #: True at ``request_finished`` (the stall has not begun yet), False during a stall.
    at_finish: bool = False
    #: The request declared its next tool call (``next_stall``).
    announced: bool = False
    #: The session's blocks are already held on device by an earlier ``keep``.
    kept: bool = False
    #: The engine's clock at this decision (seconds; the simulator's own time under ``tokencake sim``).
    now_s: float = 0.0
    #: Recent mean duration of an engine step with work in it (0 when not known yet).
    step_s: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.agent_type}/{self.tool or ''}"

    @property
    def num_blocks(self) -> int:
        return max(int(self.gate.num_blocks), 0)

    @property
    def device_used_blocks(self) -> int:
        return max(self.device_blocks - self.device_free_blocks, 0)

    @property
    def remaining_s(self) -> float:
        """Forecast seconds left in the stall (0 when unknown or over)."""
        left = self.gate.predicted_s - max(self.gate.elapsed_s, 0.0)
        return left if math.isfinite(left) and left > 0 else 0.0


@dataclass(frozen=True)
class Plan:
    """A policy's answer for one session (see the module docstring)."""

    action: Action
    #: Why (a short code counted in ``/v1/stats`` as ``policy.<name>.<reason>``).
    reason: str
    #: Ask again later in the same stall (the answer may change as pressure or room change).
    retry: bool = False
    #: ``keep``: seconds to hold the device blocks.
    keep_s: float = 0.0
    #: ``offload``: when the blocks come back to the device.
    prefetch: PrefetchMode = "predictive"
    #: ``offload``: once copied, the device copies are the first to be evicted.
    evict_first: bool = True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


NOTHING = Plan("none", "nothing")


class KVPolicy:
    """Base class: decides nothing (vLLM's own LRU); subclasses override what they use.

    ``uses_events``: the policy acts on stall events (False: only on finished requests, as a tiered
    cache without events does). ``demand_load``: next-turn requests that miss on device load what
    the host pool holds. ``admission``: the order of waiting requests the policy asks for when the
    spatial scheduler runs (``tokencake.serving.spatial.ADMISSIONS``). ``preempts_host``: a save
    that finds the host pool full may take the host copies of stalled sessions predicted to return
    later than its own (Belady's rule with the events' forecasts; the gate counts them as room).
    """

    name = "base"
    uses_events = True
    demand_load = True
    admission = "spatial"
    preempts_host = False

    def on_finished(self, view: PolicyView) -> Plan:
        """A request of this session finished; its blocks are still held by vLLM right now."""
        return NOTHING

    def on_stall(self, view: PolicyView) -> Plan:
        """The session is in a tool call (``stall_begin``, or a re-ask after a retryable answer)."""
        return NOTHING

    def observe_stall_end(self, key: str, duration_s: float) -> None:
        """A tool call of ``key`` (agent type / tool) took ``duration_s``."""

    def observe_queue_delay(self, seconds: float) -> None:
        """A request waited ``seconds`` between arrival and admission."""

    def stats(self) -> dict[str, Any]:
        return {"name": self.name}


class EventPolicy(KVPolicy):
    """A policy that decides per tool call: at ``request_finished`` only when the request announced
    its tool call, and at every ``on_stall``; subclasses implement :meth:`decide`."""

    uses_events = True

    def decide(self, view: PolicyView) -> Plan:
        raise NotImplementedError

    def on_finished(self, view: PolicyView) -> Plan:
        if not view.announced:
            return Plan("none", "not_announced")
        return self.decide(view)

    def on_stall(self, view: PolicyView) -> Plan:
        return self.decide(view)
