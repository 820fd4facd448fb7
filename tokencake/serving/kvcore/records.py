"""The KV core's records: a copy job, a stall, a device hold, a request, a watched critical
chain; host-pool owner names; the request metadata a client sends."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from pydantic import ValidationError

from tokencake.events import META_KEY, NextStall, RequestMeta
from tokencake.serving.kvcore.ports import DeviceBlock as KVCacheBlock
from tokencake.serving.kvcore.ports import RequestView
from tokencake.serving.kvcore.wire import CopyJob, JobKind
from tokencake.serving.stall_calls import StallCalls, ToolCall

#: How often an otherwise idle engine steps while copies given up after ``job_timeout_s`` are
#: still out (their late reports release device blocks and host slots).
ABANDONED_POLL_S = 1.0


#: Sessions whose last request was on the critical path (their stalls are demoted last).
CRITICAL_SESSIONS = 4096


#: Readiness of a session's blocks when its next request arrives (``readiness.*`` counters).
READINESS = ("prefetched", "not_needed", "loading", "missed")


@dataclass
class Job:
    """A copy in flight and everything it holds (released exactly once)."""

    job_id: int
    kind: JobKind
    hashes: list[bytes]
    #: Position of each block in its request's chain (for the prefix-cache token count).
    positions: list[int]
    device_blocks: list[KVCacheBlock]
    slots: list[int]
    issued_at: float
    stall_id: str | None = None
    req_id: str | None = None
    session_id: str | None = None
    #: ``reset_cache`` count when planned: a job from before a reset commits/publishes nothing.
    generation: int = 0
    #: True when the device blocks hold a reference taken by us (offload pin, prefetch allocation).
    device_owned: bool = False
    reports: int = 0
    released: bool = False
    #: False once any worker reported the copy failed.
    ok: bool = True
    #: A failed load was acted on (``_load_failed``): at the first rank's report, not the last.
    failure_acted: bool = False
    #: Timed out: nobody waits for it any more, but its pins stay until every worker reported
    #: (a copy may still be writing into those device blocks / host slots).
    abandoned: bool = False
    #: A demand load's request blocks from its first loaded one on, as allocated with it: if the
    #: load fails, these hold bad KV (loaded, or computed this step from loaded KV) until the
    #: request recomputes them — vLLM keeps their hashes meanwhile (recompute policy).
    downstream: tuple[int, tuple[int, ...]] = (0, ())  # (first position, block ids from it on)

    @property
    def owner(self) -> str:
        return self.owner_of(self.job_id)

    @staticmethod
    def owner_of(job_id: int) -> str:
        """The host-pool owner id of job ``job_id`` (its slots are pinned under it)."""
        return f"job:{job_id}"

    def to_wire(self) -> CopyJob:
        return CopyJob(
            self.job_id, self.kind, [b.block_id for b in self.device_blocks], list(self.slots), self.req_id
        )


@dataclass
class Stall:
    """The engine thread's view of one active (or just ended) stall: a session's idle chain.

    Named by its first tool call; calls of the session that begin while it is open share it
    (``calls``, ``tokencake.serving.stall_calls``): ``agent_type`` / ``tool`` are the first
    call's, ``predicted_s`` spans from ``begin_at`` to the latest return of the open calls.
    """

    stall_id: str
    session_id: str
    agent_type: str
    tool: str
    begin_at: float
    predicted_s: float
    hashes: tuple[bytes, ...]
    #: False when the session never finished a request here (nothing to offload).
    known: bool = True
    decision: str | None = None
    offloaded: bool = False
    next_eval: float = 0.0
    #: The current re-ask interval of a retryable "no" (backs off while nothing waits).
    retry_s: float = 0.0
    ended_at: float | None = None
    #: Seconds a host → device copy of the chain needs ahead of the return (transfer + margin).
    lead_s: float = 0.0
    #: The prefetch copy in flight (its timing and state live in the ``PrefetchPlanner``).
    prefetch_job: int | None = None
    #: Blocks published in the device prefix cache by prefetches of this stall.
    prefetched: list[bytes] = field(default_factory=list)
    #: Headroom refusals; a deferred prefetch waits for the next regular step.
    deferred: int = 0
    #: The last upload brought only the chain's head (budget): the rest is topped up when room frees.
    topup: bool = False
    accounted: bool = False
    #: A request of the session was admitted after the stall began (nothing left to hold for).
    resumed: bool = False
    #: The policy's plan says the device copies go first in the eviction queue once on host.
    evict_first: bool = True
    #: The session's last request was on its app's critical path: among demoted chains, evicted last.
    critical: bool = False
    #: How much of the chain was still on device or host when the stall was first decided (None:
    #: not decided yet): what was lost before then no decision could have saved.
    chain_at_decision: int | None = None
    #: What the session's announcing request decided when it finished (``early_save.decision``;
    #: None: no at-finish decision): the cause behind a chain cut before the stall's first decision.
    finish_decision: str | None = None
    #: Room kept for its return (``return_reserve``): from its upload's due time to the late end
    #: of its likely return (the plan's ``due_at`` / ``late_at``; inf: never)...
    reserve_from: float = math.inf
    reserve_until: float = math.inf
    #: ...and the blocks of its chain that need room, counted once when that window opens (the
    #: run that could come back, less the blocks others reference); its own hold is subtracted.
    reserve_blocks: int | None = None
    #: The tool calls that share it, open ones (the first call included until it ends).
    calls: StallCalls = field(init=False)

    def __post_init__(self) -> None:
        first = ToolCall(self.stall_id, self.agent_type, self.tool, self.begin_at, self.predicted_s)
        self.calls = StallCalls(first)

    @property
    def returns_at(self) -> float:
        """Predicted end of the last of its tool calls (server clock)."""
        return self.begin_at + self.predicted_s


class Watch(NamedTuple):
    """A critical-path session's idle chain, watched until its next request is admitted."""

    hashes: tuple[bytes, ...]
    #: Until when it is expected back even with no stall or request seen (its finish + the
    #: announced tool's stall expiry).
    until: float


@dataclass
class Keep:
    """Device blocks held for an idle session (one reference each, released once).

    ``kind`` is ``keep`` (a policy's plan) or ``hold`` (a prefetched chain waiting for its
    request). When room is needed the hold with the latest ``rank`` (predicted return) goes first;
    with the spatial scheduler on, non-critical sessions' holds before critical-path ones'.
    """

    session_id: str
    blocks: list[KVCacheBlock]
    until: float
    since: float
    rank: float = 0.0
    kind: str = "keep"
    #: The session's last request was on its app's critical path.
    critical: bool = False

    @property
    def releasable(self) -> int:
        """Blocks only this hold keeps on device (releasing it frees exactly these)."""
        return [b.ref_cnt for b in self.blocks].count(1)


@dataclass
class ReqInfo:
    """What the connector keeps about a request that carries TokenCake metadata."""

    session_id: str
    agent_type: str
    next_stall: NextStall | None = None
    #: The node is on its app's critical path (the SDK's graph metadata).
    critical: bool = False
    #: The client sends no stall events for this session: derive them (``RequestMeta.stall_events``).
    derive_stalls: bool = False
    run_id: str = ""
    node: str = ""
    #: A prefetch of this session was being copied when the request arrived (readiness: ``loading``).
    arrived_while_loading: bool = False
    #: When the request arrived: could the session's missing chain blocks have been uploaded then
    #: under the prefetch budget rule (None: unknown)? Taken at arrival, not when vLLM first asks
    #: for its prefix — under a long queue that is much later, and the device fuller.
    room_at_arrival: bool | None = None
    #: The node's slack in its app's DAG (seconds it can start late without delaying the app).
    slack_s: float = 0.0
    #: It waited at least one step for the critical reserve (``CriticalWatch.spare_chains``).
    reserve_waited: bool = False
    #: Its admission waited for a prefetch of its session in flight (``demand_load.waited_for_prefetch``).
    waited_for_prefetch: bool = False
    #: How many leading blocks of the session's last chain that this prompt repeats were cached on
    #: device when the request arrived (readiness; None: not known at arrival).
    device_blocks_at_arrival: int | None = None
    #: Why its session's chain would be missed, from the prefetch plan as it stood at arrival
    #: (``readiness.missed_why``; the plan moves on while the request queues).
    missed_why_at_arrival: str | None = None


def finish_owner(session_id: str) -> str:
    """Host-pool owner of an at-finish save's copies until the session's stall begins."""
    return f"finish:{session_id}"


STALL_OWNER = "stall:"


def stall_owner(stall_id: str) -> str:
    """Host-pool owner of a stall's copies.

    Stall ids come from clients, so they get their own namespace: a stall named ``job:7`` must
    not own (and on release unpin) the slots copy job 7 is still reading.
    """
    return f"{STALL_OWNER}{stall_id}"


def request_meta(request: RequestView) -> RequestMeta | None:
    """``kv_transfer_params.tokencake`` of a request, or None (absent or invalid: plain vLLM)."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict):
        return None
    raw = params.get(META_KEY)
    if not isinstance(raw, dict):
        return None
    try:
        return RequestMeta.model_validate(raw)
    except ValidationError:
        return None


__all__ = [
    "ABANDONED_POLL_S",
    "CRITICAL_SESSIONS",
    "READINESS",
    "STALL_OWNER",
    "Job",
    "Keep",
    "ReqInfo",
    "Stall",
    "Watch",
    "finish_owner",
    "request_meta",
    "stall_owner",
]
