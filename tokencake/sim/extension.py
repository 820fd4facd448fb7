"""The connector's mechanisms, on the simulated block cache, driving the server's own policy objects.

This is ``tokencake/serving/vllm/scheduler_side.py`` without vLLM: the same decision points (a
request finishes → ``policy.on_finished``; ``stall_begin`` → ``policy.on_stall``, asked again while
the answer is a retryable no), the same ``Plan`` actions (offload + prefetch mode + evict-first,
keep, discard, none), the same helpers (``OffloadGate``, ``PrefetchPlanner``, ``HostPool``,
``DurationForecaster`` are imported, not re-implemented) and the same mechanism rules: saves pin the
device blocks until copied; a confirmed copy is committed to the host pool; an offloaded idle chain
goes to the front of the eviction queue (latest return first); uploads are budgeted against the
queue and held until their request is admitted (yielding to admissions and the running requests'
next blocks); a next request loads on demand what the device lacks and the host holds.

Copies take the profile's time: inside the step on the CPU backend (the same cores), on a side
stream on a GPU (one stream: copies queue behind each other; only a demand load delays its step).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from tokencake.serving.forecast import DurationForecaster
from tokencake.serving.gate import GateInput, OffloadGate, TransferModel, remaining_s
from tokencake.serving.host_pool import HostPool, HostPoolExhausted, preemption_victims
from tokencake.serving.options import Options
from tokencake.serving.policies import KVPolicy, Plan, PolicyView, make_policy
from tokencake.serving.prefetch import PrefetchPlanner, kept_room, miss_reason, stall_expiry_s
from tokencake.serving.sessions import BlockUsers
from tokencake.serving.spatial import CRITICAL_WATCH, demote_rank, reserved_sessions
from tokencake.serving.stall_calls import StallCalls, ToolCall

if TYPE_CHECKING:
    from tokencake.sim.engine import Engine, Request, Session

__all__ = ["KVExtension"]

#: Up to this many demoted stalls the simulator re-queues them exactly as the connector does.
DEMOTE_EXACT = 16


@dataclass(eq=False)
class _Stall:
    """A session's idle chain; its concurrent tool calls share it (the connector's ``_Stall``)."""

    stall_id: str
    session: Session
    tool: str
    begin_at: float
    predicted_s: float
    keys: tuple[bytes, ...]
    decision: str | None = None
    offloaded: bool = False
    retry_at: float = math.inf
    ended_at: float | None = None
    evict_first: bool = True
    lead_s: float = 0.0
    prefetched: list[bytes] = field(default_factory=list)
    prefetch_job: _Job | None = None
    deferred: int = 0
    #: The last upload brought only the chain's head (budget): the rest is topped up when room frees.
    topup: bool = False
    accounted: bool = False
    resumed: bool = False
    retry_s: float = 0.0
    #: The session's last request was on its app's critical path.
    critical: bool = False
    #: Room kept for its return (the connector's ``_Stall.reserve_*``).
    reserve_from: float = math.inf
    reserve_until: float = math.inf
    reserve_blocks: int | None = None
    calls: StallCalls = field(init=False)

    def __post_init__(self) -> None:
        first = ToolCall(self.stall_id, self.session.agent_type, self.tool, self.begin_at, self.predicted_s)
        self.calls = StallCalls(first)

    @property
    def returns_at(self) -> float:
        return self.begin_at + self.predicted_s


@dataclass(eq=False)
class _Job:
    kind: str  # offload | prefetch | load
    keys: list[bytes]
    positions: list[int]
    blocks: list[int]
    slots: list[int]
    owner: str
    done_at: float = math.inf
    stall: _Stall | None = None
    session_id: str = ""
    issued_at: float = 0.0


@dataclass(frozen=True)
class _Arrival:
    """How a session's chain stood when its next request arrived (readiness is judged then)."""

    room: bool  # the device had room for the missing blocks
    loading: bool  # a prefetch of the session was being copied
    device_blocks: int  # leading chain blocks cached on device
    missed_why: str  # ``miss_reason`` from the plan as it stood
    log: dict[str, Any] | None = None  # its ``arrival_log`` entry, completed when it is accounted


@dataclass(eq=False)
class _Hold:
    session_id: str
    blocks: list[int]
    until: float
    since: float
    rank: float
    kind: str  # keep | hold
    critical: bool = False


class KVExtension:
    def __init__(self, options: Options | None = None, *, host_blocks: int) -> None:
        """``options`` are the connector's (its defaults)."""
        self.opts = options or Options()
        self.host = HostPool(host_blocks)
        self.stats: Counter[str] = Counter()
        self.engine: Engine | None = None
        #: The spatial scheduler's eviction side (the connector's ``critical_last``): critical-path
        #: sessions' chains evicted last among demoted ones, their holds yield last and up to
        #: ``critical_reserve_frac`` of them are a reserve against non-critical admissions. Set by
        #: the engine's ``spatial`` scheduling (unless ``Options.critical_last`` is false).
        self.critical_last = False

    # ------------------------------------------------------------------ set-up
    def bind(self, engine: Engine) -> None:
        self.engine = engine
        self.cache = engine.cache
        p = engine.profile
        self.profile = p
        self.block_size = p.block_size
        self.transfer = TransferModel(
            d2h_bytes_per_s=p.d2h_bytes_per_s, h2d_bytes_per_s=p.h2d_bytes_per_s, base_s=p.copy_base_s
        )
        self.gate = OffloadGate(
            self.transfer,
            enabled=self.opts.offload,
            usage_threshold=self.opts.usage_threshold,
            min_waiting=self.opts.min_waiting,
        )
        self.policy: KVPolicy = make_policy(self.opts.policy, gate=self.gate, seed=self.opts.policy_seed)
        self.forecaster = DurationForecaster()
        o = self.opts
        self.planner = PrefetchPlanner(  # as the connector builds it
            clock=lambda: engine.now,
            safety_margin_s=o.prefetch_margin_s,
            expiry_factor=o.expiry_factor,
            expiry_min_s=o.expiry_min_s,
            expiry_max_s=o.expiry_max_s,
            unused_after_s=o.end_grace_s,
            return_quantile=o.prefetch_quantile,
            prior_ratio=o.prefetch_prior_ratio,
        )
        self._stalls: dict[str, _Stall] = {}  # active (tool running)
        #: Block key -> the active stalls whose chain holds it (a shared prompt: several).
        self._stall_users = BlockUsers()
        self._session_stall: dict[str, _Stall] = {}  # session -> its active stall
        self._call_stall: dict[str, _Stall] = {}  # open tool call -> the active stall it shares
        self._last_stall: dict[str, _Stall] = {}  # session -> its last ended stall (next-turn accounting)
        self._chains: dict[str, list[bytes]] = {}  # session -> keys of its last finished request
        self._jobs: list[_Job] = []
        self._filling: dict[bytes, _Job] = {}
        self._holds: dict[str, _Hold] = {}
        #: A running request found no free block this pass (``free_for_running``).
        self._short_pass = False
        #: Sessions whose return is reserved (``return_reserve``): session -> blocks kept for it.
        self._returning: dict[str, int] = {}
        self._reserves_returns = self.opts.reserves_returns(copies_beside_compute=p.copies_async)
        # Insertion-ordered (dicts, not sets): the simulation must not depend on object addresses.
        self._demoted: dict[_Stall, None] = {}
        self._pending_copy_s = 0.0
        #: When each side stream is next free: saves (D2H) and prefetches (H2D) have their own, as
        #: the connector's copy lanes do (measured on an H200: each direction keeps ~90 % of its
        #: bandwidth while the other runs; ``docs/simulation.md`` §4).
        self._stream_free_at = {"d2h": 0.0, "h2d": 0.0}
        self._next_job = 0
        self._loading_sessions: dict[str, _Job] = {}
        #: A session's next turn -> how its chain stood when the request arrived (readiness).
        self._arrivals: dict[int, _Arrival] = {}
        #: Set to a list to record the device's state at each next-turn arrival (why no room:
        #: ``benchmarks/no_room_sim.py``); None records nothing.
        self.arrival_log: list[dict[str, Any]] | None = None
        self._seen_evictions = -1
        self._retries: list[tuple[float, int, _Stall]] = []
        self._retry_seq = itertools.count()
        self._was_waiting = False
        #: Stalls whose chain a prefetch put back while the tool still runs (checked for eviction).
        self._prefetched_running: dict[_Stall, None] = {}
        #: Stalls whose upload brought only the chain's head (``_Stall.topup``).
        self._topups: dict[_Stall, None] = {}
        self._critical: dict[str, bool] = {}  # session -> its last request was critical
        # Critical-path sessions whose idle chain is watched for critical inversions, and the
        # sessions watching each key (the connector's ``_critical_idle``).
        self._critical_idle: dict[str, tuple[tuple[bytes, ...], float]] = {}  # (keys, expected back until)
        self._watchers: dict[bytes, set[str]] = {}

    @property
    def now(self) -> float:
        assert self.engine is not None
        return self.engine.now

    # ------------------------------------------------------------------ views
    def _chain(
        self, keys: list[bytes] | tuple[bytes, ...]
    ) -> list[tuple[int, bytes, int | None, int | None]]:
        """``(position, key, device block, host slot)`` of the usable prefix (as the connector's)."""
        dev = self.cache.by_key.get
        out = []
        for i, (k, slot) in enumerate(zip(keys, self.host.lookup_many(keys), strict=True)):
            d = dev(k)
            if d is None and slot is None:
                break
            out.append((i, k, d, slot))
        return out

    def _eviction_risk(self, keyset: set[bytes], left_s: float) -> float:
        """The connector's ``_eviction_risk``: allocations expected before the return over the free
        blocks vLLM evicts before the chain's first idle block (its position in the free queue)."""
        assert self.engine is not None
        cache = self.cache
        idle = [b for b in (cache.by_key.get(k) for k in keyset) if b is not None and cache.ref[b] == 0]
        if not idle:
            return 0.0
        expected = self.engine.waiting_blocks() + max(
            self.opts.churn_safety * self.engine.alloc_rate() * max(left_s, 0.0),
            self.profile.max_batched_tokens / self.block_size,
        )
        ahead = cache.blocks_ahead(idle)
        if ahead is None:
            return 0.0
        return 1.0 if ahead == 0 else min(1.0, expected / ahead)

    def _view(
        self,
        chain: list,
        predicted: float,
        elapsed: float,
        session: Session,
        tool: str | None,
        *,
        at_finish: bool,
        announced: bool,
    ) -> PolicyView:
        assert self.engine is not None
        on_host = sum(1 for _i, k, _d, s in chain if s is not None or k in self._filling)
        left = remaining_s(predicted, elapsed, self.gate.overdue_factor)
        short = len(chain) - on_host - self.host.num_free - self.host.num_reclaimable
        preemptible = 0
        if short > 0:
            own = {k for _i, k, _d, _s in chain}
            preemptible = len(self._host_victims(self.now + left, session.session_id, limit=short, own=own))
        gate = GateInput(
            predicted_s=predicted,
            num_blocks=len(chain),
            block_bytes=self.profile.block_bytes,
            device_usage=self._eviction_risk({k for _i, k, d, _s in chain if d is not None}, left),
            num_waiting=len(self.engine.waiting),
            host_free_blocks=self.host.num_free,
            num_on_host=on_host,
            host_reclaimable_blocks=self.host.num_reclaimable,
            host_preemptible_blocks=preemptible,
            elapsed_s=elapsed,
        )
        return PolicyView(
            gate=gate,
            session_id=session.session_id,
            agent_type=session.agent_type,
            tool=tool,
            device_blocks=self.cache.num_blocks,
            device_free_blocks=self.cache.num_free,
            waiting_blocks=self.engine.waiting_blocks(),
            recompute_s=self.profile.recompute_s(len(chain) * self.block_size),
            d2h_s=self.transfer.estimate("d2h", max(len(chain) - on_host, 0) * self.profile.block_bytes),
            h2d_s=self.transfer.estimate("h2d", len(chain) * self.profile.block_bytes),
            at_finish=at_finish,
            announced=announced,
            kept=session.session_id in self._holds,
            now_s=self.now,
            step_s=self.engine.mean_step_s(),
        )

    def _count(self, where: str, plan: Plan) -> None:
        self.stats[f"policy.{where}.{plan.action}"] += 1
        self.stats[f"policy.reason.{plan.reason}"] += 1

    # ------------------------------------------------------------------ copies
    def _new_job(
        self, kind: str, keys: list, positions: list[int], blocks: list[int], slots: list[int], **kw: Any
    ) -> _Job:
        self._next_job += 1
        job = _Job(kind, keys, positions, blocks, slots, f"job:{self._next_job}", issued_at=self.now, **kw)
        direction = "d2h" if kind == "offload" else "h2d"
        t = self.profile.copy_s(direction, len(blocks))
        self.stats[f"{kind}.blocks"] += len(blocks)
        self.stats[f"{kind}.jobs"] += 1
        if kind == "load" or not self.profile.copies_async:
            self._pending_copy_s += t  # inside the step: same cores (CPU) or a demand load
            job.done_at = -math.inf  # completes at the end of the step it ships with
        else:
            start = max(self._stream_free_at[direction], self.now)
            self._stream_free_at[direction] = job.done_at = start + t
        self._jobs.append(job)
        return job

    def step_copy_s(self, _loads: int) -> float:
        t, self._pending_copy_s = self._pending_copy_s, 0.0
        return t

    def _host_victims(self, returns_at: float, session_id: str, *, limit: int, own: set[bytes]) -> list[int]:
        """The connector's ``_host_victims``: host slots of offloaded stalls predicted to return
        later than ``returns_at`` (latest first, each chain tail first) that nothing else owns."""
        if not self.policy.preempts_host or not self._stalls:
            return []
        assert self.engine is not None
        waiting = {r.session.session_id for r in self.engine.waiting}
        later: list[tuple[float, str, tuple[bytes, ...]]] = []
        for stall in self._stalls.values():
            sid = stall.session.session_id
            if (
                not stall.offloaded
                or stall.ended_at is not None
                or sid == session_id
                or sid in waiting
                or sid in self._loading_sessions
            ):
                continue
            elapsed = self.now - stall.begin_at
            back = self.now + remaining_s(stall.predicted_s, elapsed, self.gate.overdue_factor)
            if back > returns_at:
                later.append((back, stall.stall_id, stall.keys))
        return preemption_victims(self.host, later, limit=limit, own=own) if later else []

    def _plan_offload(
        self, chain: list, *, stall: _Stall | None, session_id: str, returns_at: float | None = None
    ) -> _Job | None:
        todo = [(i, k, d) for i, k, d, s in chain if s is None and d is not None and k not in self._filling]
        if not todo:
            return None
        victims: list[int] = []
        short = len(todo) - self.host.num_free - self.host.num_reclaimable
        if returns_at is not None and short > 0:
            own = {k for _i, k, _d, _s in chain}
            victims = self._host_victims(returns_at, session_id, limit=short, own=own)
        losers = {slot: self.host.owners(slot) for slot in victims}
        slots = self.host.allocate(len(todo), f"job:{self._next_job + 1}", victims)
        taken = [slot for slot in slots if slot in losers]
        if taken:
            self.stats["host.preempted_blocks"] += len(taken)
            for stall_id in {o for slot in taken for o in losers[slot]}:
                lost = self._stalls.get(stall_id)
                if lost is not None:
                    self.stats["host.preempted_stalls"] += 1
                    self._promote(lost)
        blocks = [d for _i, _k, d in todo]
        self.cache.touch(blocks)
        job = self._new_job(
            "offload",
            [k for _i, k, _d in todo],
            [i for i, _k, _d in todo],
            blocks,
            slots,
            stall=stall,
            session_id=session_id,
        )
        for k in job.keys:
            self._filling[k] = job
        return job

    def after_step(self, now: float, _dt: float) -> None:
        """Complete the copies that are done by ``now`` (CPU: every copy of the step just run)."""
        done = [j for j in self._jobs if j.done_at <= now]
        if not done:
            return
        self._jobs = [j for j in self._jobs if j.done_at > now]
        for job in done:
            getattr(self, f"_complete_{job.kind}")(job)

    def _complete_offload(self, job: _Job) -> None:
        stall = self._session_stall.get(job.session_id)
        for k, b, slot in zip(job.keys, job.blocks, job.slots, strict=True):
            if self._filling.get(k) is job:
                del self._filling[k]
            if self.cache.key[b] == k:
                used = self.host.commit(k, slot)  # type: ignore[arg-type]
                if stall is not None and stall.offloaded:
                    self.host.pin(used, stall.stall_id)
            else:
                self.host.invalidate(slot)
        self.host.release(job.owner)
        self.host.touch(reversed(job.slots))
        self.cache.release(list(reversed(job.blocks)))
        if stall is not None and stall.offloaded and not self._offload_pending(stall):
            self._demote(stall)

    def _complete_prefetch(self, job: _Job) -> None:
        stall = job.stall
        if self._loading_sessions.get(job.session_id) is job:
            del self._loading_sessions[job.session_id]
        published = []
        for k, b in zip(job.keys, job.blocks, strict=True):
            if self.cache.cache(b, k):
                published.append(k)
        self.host.release(job.owner)
        self.cache.release(list(reversed(job.blocks)))
        if stall is not None:
            stall.prefetched.extend(published)
            stall.prefetch_job = None
            self.planner.mark_done(stall.stall_id, now=self.now)
            if stall.ended_at is None:
                self._prefetched_running[stall] = None
            self._hold_prefetched(stall)

    def _complete_load(self, job: _Job) -> None:
        self.host.release(job.owner)
        self.host.touch(reversed(job.slots))

    def _offload_pending(self, stall: _Stall) -> bool:
        return bool(self._filling) and any(k in self._filling for k in stall.keys)

    # ------------------------------------------------------------------ eviction order
    def _chain_blocks(self, stall: _Stall, *, on_host_only: bool, first_in_line: bool = False) -> list[int]:
        """As the connector's: ``first_in_line`` leaves out blocks another stall keeps longer."""
        out = []
        for k in stall.keys:
            b = self.cache.lookup(k)
            if b is None or (on_host_only and self.host.lookup(k) is None):  # type: ignore[arg-type]
                continue
            if first_in_line and self._kept_by_another(stall, k):
                continue
            out.append(b)
        out.reverse()
        return out

    def _kept_by_another(self, stall: _Stall, k: Any) -> bool:
        """The connector's ``_kept_by_another``: another active stall holding block ``k`` that is
        not demoted, or demoted behind ``stall`` (an equal or lower eviction rank)."""
        others = self._stall_users.others(stall.stall_id, k)
        if not others:
            return False
        rank = self._evict_rank(stall)
        return any(
            (other := self._stalls.get(sid)) is not None
            and (other not in self._demoted or self._evict_rank(other) <= rank)
            for sid in others
        )

    def _add_stall(self, stall: _Stall) -> None:
        self._stalls[stall.stall_id] = stall
        self._stall_users.add(stall.stall_id, stall.keys)
        self._session_stall[stall.session.session_id] = stall
        self._call_stall[stall.stall_id] = stall

    def _pop_stall(self, stall_id: str) -> _Stall | None:
        stall = self._stalls.pop(stall_id, None)
        if stall is not None:
            self._stall_users.remove(stall_id, stall.keys)
            if self._session_stall.get(stall.session.session_id) is stall:
                del self._session_stall[stall.session.session_id]
            for call_id in stall.calls.open:
                self._call_stall.pop(call_id, None)
        return stall

    def _demote(self, stall: _Stall) -> None:
        if not self.opts.demote or not stall.evict_first or stall.stall_id not in self._stalls:
            return
        self._demoted[stall] = None
        # The connector re-queues every demoted chain, latest return first in line. When the new
        # stall returns last (the usual case) only its chain moves: the same order, O(chain).
        # Beyond DEMOTE_EXACT demoted stalls the simulator moves only the new chain (an
        # approximation: O(demoted × chain) per offload is its hot loop at 1,000 agents).
        rank = self._evict_rank
        if len(self._demoted) > DEMOTE_EXACT or all(rank(s) <= rank(stall) for s in self._demoted):
            order = [stall]
        else:
            order = sorted(self._demoted, key=lambda s: (*rank(s), s.stall_id))
        for s in order:
            self.stats["evict_order.demoted_blocks"] += self.cache.move(
                self._chain_blocks(s, on_host_only=True, first_in_line=True), front=True
            )

    def _evict_rank(self, stall: _Stall) -> tuple[int, float]:
        """As the connector's: the highest rank is evicted first."""
        return demote_rank(critical=stall.critical and self.critical_last, returns_at=stall.returns_at)

    def _promote(self, stall: _Stall) -> None:
        if stall in self._demoted:
            del self._demoted[stall]
            self.cache.move(self._chain_blocks(stall, on_host_only=False), front=False)

    # ------------------------------------------------------------------ holds (keep / prefetched)
    def holds_kv(self, session_id: str) -> bool:
        """Whether the session's chain is held on device for it (the spatial score's retained
        credit, as ``SchedulerSide.holds_kv``)."""
        return session_id in self._holds

    def saved_kv(self, session_id: str) -> bool:
        """Whether at least half of the session's last chain is on host from its head (the spatial
        score's saved credit, as ``SchedulerSide.saved_kv``)."""
        return self.host.saves_most_of(self._chains.get(session_id, ()))

    def _hold(self, session_id: str, blocks: list[int], until: float, *, rank: float, kind: str) -> None:
        held = self._holds.get(session_id)
        have = set(held.blocks) if held is not None else set()
        new = [b for b in blocks if b not in have]
        if held is None and not new:
            return
        self.cache.touch(new)
        if held is not None:
            held.blocks.extend(new)
            held.until = max(held.until, until)
            return
        critical = self._critical.get(session_id, False)
        self._holds[session_id] = _Hold(session_id, new, until, self.now, rank, kind, critical)
        self.stats[f"{kind}.sessions"] += 1

    def _unhold(self, session_id: str, why: str) -> None:
        held = self._holds.pop(session_id, None)
        if held is not None:
            self.cache.release(list(reversed(held.blocks)))
            self.stats[f"{held.kind}.released.{why}"] += 1

    def _hold_rank(self, held: _Hold) -> tuple[int, float]:
        return demote_rank(critical=held.critical and self.critical_last, returns_at=held.rank)

    def _release_holds_until(
        self, enough: Any, why: str, spare: str = "", protect: frozenset[str] = frozenset()
    ) -> None:
        for held in sorted(self._holds.values(), key=self._hold_rank, reverse=True):
            if enough():
                return
            if held.session_id != spare and held.session_id not in protect:
                self._unhold(held.session_id, why)

    def _protected(self, req: Request) -> frozenset[str]:
        """The critical reserve against this admission, as the connector's ``_protected``: only
        with the spatial scheduler on, only against a non-critical request that waited less than
        ``critical_reserve_wait_s``, the holds of the critical sessions that return soonest while
        they fit in ``critical_reserve_frac`` of the device; never against a plain request."""
        if not self.critical_last or not req.run_id or req.priority == 0 or req.admitted_at is not None:
            return frozenset()
        if self._reserve_waited(req) >= self.opts.critical_reserve_wait_s:
            return frozenset()
        cap = int(self.opts.critical_reserve_frac * self.cache.num_blocks)
        ref = self.cache.ref
        holds = (
            (h.session_id, h.rank, sum(ref[b] == 1 for b in h.blocks))
            for h in self._holds.values()
            if h.critical
        )
        return reserved_sessions(holds, cap)

    def _reserve(self) -> int:
        return max(
            self.opts.prefetch_reserve_blocks, int(self.opts.prefetch_reserve_frac * self.cache.num_blocks)
        )

    def _reserve_returns(self, now: float) -> dict[str, int]:
        """The connector's ``_reserve_returns``: the stalls whose tool still runs and whose
        upload is due, until the late end of their likely return, soonest due first while they
        fit in ``return_reserve_frac`` of the device; each keeps the blocks of its returnable
        chain that no one but its own hold references (counted when the window opens, its hold
        subtracted as it grows)."""
        if not self._reserves_returns or not self._stalls:
            return {}
        due = []
        for stall in self._stalls.values():
            if (
                not (stall.accounted or stall.resumed)
                and stall.offloaded
                and stall.reserve_from <= now <= stall.reserve_until
            ):
                due.append(stall)
            else:
                stall.reserve_blocks = None
        cap = int(self.opts.return_reserve_frac * self.cache.num_blocks)
        return kept_room(
            ((st.reserve_from, st.session.session_id, partial(self._kept_for, st)) for st in due), cap
        )

    def _kept_for(self, stall: _Stall) -> int | None:
        """The connector's ``_kept_for``."""
        held = self._holds.get(stall.session.session_id)
        if stall.reserve_blocks is None:
            if self._offload_pending(stall):
                return None
            stall.reserve_blocks = self._room_to_return(stall, held)
        copying = len(stall.prefetch_job.blocks) if stall.prefetch_job is not None else 0
        return stall.reserve_blocks - (len(held.blocks) if held is not None else 0) - copying

    def _room_to_return(self, stall: _Stall, held: _Hold | None) -> int:
        """The connector's ``_room_to_return``."""
        own = set(held.blocks) if held is not None else set()
        by_key, ref, n = self.cache.by_key, self.cache.ref, 0
        for k in stall.keys:
            b = by_key.get(k)
            if b is None:
                if self.host.lookup(k) is None:  # type: ignore[arg-type]
                    break
                n += 1
            elif ref[b] - (b in own) == 0:
                n += 1
        return n

    def _returning_against(self, req: Request) -> frozenset[str]:
        """The connector's ``_returning_against``: returns whose kept room an agent request's
        first admission must leave free while requests run, never its own session's."""
        assert self.engine is not None
        if not self._returning or not req.run_id or req.admitted_at is not None or not self.engine.running:
            return frozenset()
        own = req.session.session_id
        return frozenset(sid for sid in self._returning if sid != own)

    def make_room(self, req: Request, need: int) -> bool:
        """The connector's ``_make_room`` for holds and kept room. With room kept against it (a
        due return): the request waits a step unless it fits beside the kept room, and releases
        no hold (the holds are chains of sessions about to return too). Otherwise: release the
        holds it needs the blocks of. True: it waits a step and the engine looks at the next
        request (the connector's ``return_reserve.denials`` / ``spatial.reserve_denials``: it
        would fit only if the critical reserve were lent)."""
        if not self._holds and not self._returning:
            return False
        returning = self._returning_against(req)
        if returning:
            if self.cache.num_free - need < sum(self._returning[sid] for sid in returning):
                self.stats["return_reserve.denials"] += 1
                return True
            return False
        if not self._holds or self.cache.num_free >= need:
            return False
        own = req.session.session_id
        protect = self._protected(req)
        releasable = self._held_blocks(lambda sid: sid != own and sid not in protect)
        if self.cache.num_free + releasable >= need:
            self._release_holds_until(lambda: self.cache.num_free >= need, "room", spare=own, protect=protect)
            return False
        if protect and self.cache.num_free + releasable + self._held_blocks(protect.__contains__) >= need:
            self.stats["spatial.reserve_denials"] += 1
            return True
        return False

    def free_for_running(self) -> bool:
        """The connector's ``free_for_running``: a running request found no free block, so holds
        yield (latest return first) until one frees; True: no preemption, the pass ends."""
        if not self._holds:
            return False
        before = self.cache.num_free
        self._release_holds_until(lambda: self.cache.num_free > before, "running")
        if self.cache.num_free <= before:
            return False
        self.stats["hold.yielded_to_running"] += 1
        self._short_pass = True  # this step's prefetches spare none of them (``_keep_free``)
        return True

    def _held_blocks(self, of: Callable[[str], bool]) -> int:
        """Blocks that releasing the holds of the sessions ``of`` accepts would free (nothing
        else references them)."""
        ref = self.cache.ref
        return sum(sum(ref[b] == 1 for b in h.blocks) for h in self._holds.values() if of(h.session_id))

    # ------------------------------------------------------------------ critical inversions
    def _watch(self, session_id: str, keys: tuple[bytes, ...], until: float) -> None:
        self._unwatch(session_id)
        self._critical_idle[session_id] = (keys, until)
        for k in keys:
            self._watchers.setdefault(k, set()).add(session_id)
        if len(self._critical_idle) > CRITICAL_WATCH:  # the connector watches the latest ones
            self._unwatch(next(iter(self._critical_idle)))

    def _unwatch(self, session_id: str) -> None:
        keys, _until = self._critical_idle.pop(session_id, ((), 0.0))
        for k in keys:
            sids = self._watchers.get(k)
            if sids is not None:
                sids.discard(session_id)
                if not sids:
                    del self._watchers[k]

    def spare_critical_chains(self, req: Request, need: int, hit: Sequence[int] = ()) -> bool:
        """The connector's ``_spare_critical_chains``: before a non-critical admission allocates
        ``need`` blocks, the idle blocks of critical-path chains away on a tool call (or whose
        request waits) that have no host copy and sit in the eviction window move to the back;
        from an admission that may wait for the critical reserve (within its slack and
        ``critical_reserve_wait_s``, while requests run) the host-safe ones too, and if one is
        still in the window it waits a step (True). The request's own prefix hits (``hit``: taken
        before it allocates) are stepped over and its own session's chain is never reserved."""
        if not self.critical_last or req.priority == 0 or not self._watchers:
            return False
        assert self.engine is not None
        engine, watched, now, active = self.engine, self._critical_idle, self.now, self._session_stall
        waiting: set[str] | None = None  # built only if a watched block is in the window
        may_wait = self.opts.critical_reserve_frac > 0 and self._within_slack(req)
        own, cache = req.session.session_id, self.cache
        skip = {cache.key[b] for b in hit}
        window = need - sum(1 for b in hit if cache.ref[b] == 0)

        def back(sid: str) -> bool:
            nonlocal waiting
            if now < watched[sid][1] or sid in active:
                return True
            if waiting is None:
                waiting = {r.session.session_id for r in engine.waiting}
            return sid in waiting

        def reserved(k: Any) -> bool:
            sids = self._watchers.get(k) if k is not None else None
            return bool(sids) and any(sid != own and back(sid) for sid in sids)

        spare_safe = may_wait or self.opts.critical_spare_late

        def spare(k: Any) -> bool:
            return reserved(k) and (spare_safe or self.host.lookup(k) is None)

        found = self._eviction_window(spare, window, skip)
        if found:
            self.stats["spatial.critical_spared_blocks"] += self.cache.move(found, front=False)
        if (
            not may_wait
            or not found
            or self.cache.num_free < need
            or not self._eviction_window(reserved, window, skip)
        ):
            return False
        self.stats["spatial.critical_reserve_waits"] += 1
        if not req.reserve_waited:
            req.reserve_waited = True
            self.stats["spatial.critical_reserve_waited_requests"] += 1
        return True

    def _within_slack(self, req: Request) -> bool:
        """The connector's ``_within_slack``: a non-critical request on its first admission that
        has waited less than its slack and ``critical_reserve_wait_s``, while requests run, could
        still wait without delaying its app."""
        assert self.engine is not None
        return (
            bool(self.engine.running)
            and req.admitted_at is None
            and self._reserve_waited(req) < min(float(req.priority), self.opts.critical_reserve_wait_s)
        )

    def _reserve_waited(self, req: Request) -> float:
        """How long the request has waited by the reserve's clock (``critical_reserve_wait_from``):
        since its arrival, or since the engine first looked at it (the head of the queue)."""
        start = req.arrival
        if self.opts.critical_reserve_wait_from == "head" and req.seen_at is not None:
            start = req.seen_at
        return self.now - start

    def _eviction_window(self, wanted: Any, need: int, skip: set[Any] | None = None) -> list[Any]:
        """The free blocks whose key is ``wanted`` evicted before ``need`` others, front first
        (blocks whose key is in ``skip`` are stepped over)."""
        cache, found, others = self.cache, [], 0
        for b in cache.free:
            if others >= need:
                break
            k = cache.key[b]
            if skip and k is not None and k in skip:
                continue
            if wanted(k):
                found.append(b)
            else:
                others += 1
        return found

    def on_allocated(self, req: Request, evicted: list[Any]) -> None:
        """A waiting request was allocated blocks, evicting the cached ``evicted`` keys: a
        non-critical one that took a watched critical chain's block is a critical inversion
        (``unsaved`` when a block it took has no host copy; ``late`` when the request could not
        have waited without delaying its own app), as the connector counts them."""
        if req.priority == 0 or not evicted or not self._watchers:
            return
        late = not self._within_slack(req)
        lost: dict[str, list[Any]] = {}
        for k in evicted:
            for sid in self._watchers.get(k, ()):
                lost.setdefault(sid, []).append(k)
        for keys in lost.values():
            unsaved = sum(self.host.lookup(k) is None for k in keys)
            self.stats["spatial.critical_inversions"] += 1
            self.stats["spatial.critical_blocks_evicted"] += len(keys)
            self.stats["spatial.critical_inversions_late"] += late
            if unsaved:
                self.stats["spatial.critical_inversions_unsaved"] += 1
                self.stats["spatial.critical_blocks_evicted_unsaved"] += unsaved

    def _hold_prefetched(self, stall: _Stall) -> None:
        if not self.opts.hold_prefetched or stall.accounted or stall.resumed:
            return
        blocks = []
        for k in stall.keys:
            b = self.cache.lookup(k)
            if b is None:
                break
            blocks.append(b)
        if not blocks:
            return
        if stall.ended_at is not None:
            until = stall.ended_at + self.opts.keep_after_end_s
        else:
            until = stall.calls.deadline(self._expiry)
        self._hold(stall.session.session_id, blocks, until, rank=stall.returns_at, kind="hold")

    def _expiry(self, predicted: float) -> float:
        return stall_expiry_s(
            predicted,
            factor=self.opts.expiry_factor,
            min_s=self.opts.expiry_min_s,
            max_s=self.opts.expiry_max_s,
        )

    # ------------------------------------------------------------------ engine hooks
    def on_new_request(self, req: Request) -> None:
        """As the connector: the session's host copies stay pinned while this request waits, and
        readiness is judged now, at arrival, not when the engine first asks for its prefix."""
        sid = req.session.session_id
        self.planner.on_waiting(sid, now=self.now)
        stall = self._last_stall.get(sid)
        if stall is None or stall.accounted:
            return
        room = self._room_for_chain(req)
        log = self._log_arrival(req, stall, room) if self.arrival_log is not None else None
        chain = min(len(stall.keys), (req.prompt_tokens - 1) // self.block_size)
        on_device = 0
        for k in stall.keys[:chain]:
            if self.cache.lookup(k) is None:
                break
            on_device += 1
        self._arrivals[req.rid] = _Arrival(
            room=room,
            loading=sid in self._loading_sessions,
            device_blocks=on_device,
            missed_why=miss_reason(
                self.planner.get(stall.stall_id), room_at_arrival=room, deferred=stall.deferred
            ),
            log=log,
        )

    def host_match(self, req: Request, first: int, limit: int) -> list[int] | None:
        sid = req.session.session_id
        job = self._loading_sessions.get(sid)
        # As the connector: wait for the session's own prefetch, bounded from the copy's issue.
        if job is not None and self.now - job.issued_at < self.opts.prefetch_wait_s:
            return None
        if not self.opts.demand_load or not self.policy.demand_load or self.host.num_blocks == 0:
            return []
        found = []
        for k in req.session.keys(limit, first):
            slot = self.host.lookup(k)  # type: ignore[arg-type]
            if slot is None:
                break
            found.append(slot)
        return found

    def load(self, req: Request, first: int, slots: list[int]) -> None:
        blocks = req.blocks[first : first + len(slots)]
        job = self._new_job(
            "load",
            req.session.keys(first + len(slots), first),
            list(range(first, first + len(slots))),
            blocks,
            slots,
        )
        self.host.pin_many(slots, job.owner)
        self.stats["demand_load.requests"] += 1

    def on_admitted(self, req: Request, local_blocks: int, host_blocks: int) -> None:
        sid = req.session.session_id
        for stall in (self._session_stall.get(sid), self._last_stall.get(sid)):
            if stall is not None:
                stall.resumed = True
        if sid in self._holds:
            self._unhold(sid, "admitted")
        self._unwatch(sid)  # its blocks are in use again
        self._account_next_turn(req, local_blocks, host_blocks)
        if req.seen_at is not None:
            self.policy.observe_queue_delay(max(self.now - req.arrival, 0.0))

    def _keep_free(self, exclude: Request | None = None, *, ahead_of_queue: bool = False) -> int:
        """Blocks a prefetch must leave free (the connector's ``_keep_free``): the larger of the
        reserve, one per running request and what the queued requests but ``exclude`` need (not
        the queue's for a return kept ahead of it)."""
        assert self.engine is not None
        if self._short_pass:
            return self.cache.num_free
        queued = 0 if ahead_of_queue else self.engine.waiting_blocks(exclude=exclude)
        return max(self._reserve(), len(self.engine.running), queued)

    def _chain_state(self, keys: Sequence[Any]) -> tuple[int, int]:
        """(blocks of the chain missing on device, idle ones cached there)."""
        missing = own_idle = 0
        for k in keys:
            b = self.cache.lookup(k)
            if b is None:
                missing += 1
            else:
                own_idle += self.cache.ref[b] == 0
        return missing, own_idle

    def _log_arrival(self, req: Request, stall: _Stall, room: bool) -> dict[str, Any]:
        assert self.engine is not None and self.arrival_log is not None
        missing, own_idle = self._chain_state(stall.keys)
        others = [r for r in self.engine.waiting if r is not req]
        entry: dict[str, Any] = {
            "t": self.now,
            "room": room,
            "chain": len(stall.keys),
            "missing": missing,
            "free": self.cache.num_free - own_idle,  # free blocks not of this chain
            "running": len(self.engine.running),
            "queued": len(others),
            "queued_blocks": self.engine.waiting_blocks(exclude=req),
            "head_blocks": others[0].queued_blocks if others else 0,
            "keep_free": self._keep_free(exclude=req),
            "eligible": False,  # set when the request is accounted (stall longer than its lead)
        }
        self.arrival_log.append(entry)
        return entry

    def _room_for_chain(self, req: Request) -> bool:
        sid = req.session.session_id
        stall = self._last_stall.get(sid) or self._session_stall.get(sid)
        if stall is None:
            return True
        assert self.engine is not None
        missing, own_idle = self._chain_state(stall.keys)
        if missing == 0:  # a chain still whole on device needs no room
            return True
        room = self.cache.num_free - own_idle - self._keep_free(exclude=req)
        if room >= missing:
            return True
        return room + self._held_blocks(lambda other: other != sid) >= missing

    def _account_next_turn(self, req: Request, local_blocks: int, host_blocks: int) -> None:
        sid = req.session.session_id
        stall = self._last_stall.get(sid)
        if stall is None or stall.accounted:
            return
        stall.accounted = True
        chain = min(len(stall.keys), (req.prompt_tokens - 1) // self.block_size)
        device = min(local_blocks, chain)
        served = min(local_blocks + host_blocks, chain)
        bs = self.block_size
        self.stats["next_turn.requests"] += 1
        self.stats["next_turn.prefix_tokens"] += chain * bs
        self.stats["next_turn.prefix_tokens_device"] += device * bs
        self.stats["next_turn.prefix_tokens_host"] += (served - device) * bs
        self.stats["next_turn.prefix_tokens_recomputed"] += (chain - served) * bs
        if stall.critical:
            self.stats["next_turn.critical.prefix_tokens"] += chain * bs
            self.stats["next_turn.critical.prefix_tokens_recomputed"] += (chain - served) * bs
        on_device = device >= chain
        # Readiness, judged at arrival (``on_new_request``): a prefetch that lands while the request
        # queues was not ready for it.
        arrival = self._arrivals.pop(req.rid, None)
        ended = stall.ended_at if stall.ended_at is not None else self.now
        if chain > 0 and ended - stall.begin_at > stall.lead_s:
            if arrival is not None and arrival.loading:
                ready = "loading"
            elif arrival.device_blocks >= chain if arrival is not None else on_device:
                ready = "prefetched" if stall.prefetched else "not_needed"
            else:
                ready = "missed"
                why = arrival.missed_why if arrival is not None else "not_asked"
                self.stats[f"readiness.missed_why.{why}"] += 1
            self.stats["readiness.eligible"] += 1
            self.stats[f"readiness.{ready}"] += 1
            if arrival is not None and arrival.log is not None:
                arrival.log.update(eligible=True, ready=ready)
            if arrival is not None and not arrival.room:
                self.stats["readiness.no_room"] += 1
                self.stats[f"readiness.no_room_{ready}"] += 1
        classified = self.planner.on_request(sid, hit_on_device=on_device, partial=stall.topup, now=self.now)
        for _sid, cls in classified:
            self.stats[f"prefetch.{cls}"] += 1
        self._release_stall(stall)
        del self._last_stall[sid]

    def _release_stall(self, stall: _Stall) -> None:
        self.host.release(stall.stall_id)
        self._demoted.pop(stall, None)

    def on_finished(self, req: Request) -> None:
        """A request finished (its blocks are still held): ask the policy, as ``request_finished`` does."""
        session = req.session
        self._arrivals.pop(req.rid, None)  # judged at admission; a request never admitted leaves none
        full = min(req.num_computed, req.prompt_tokens + req.output_tokens) // self.block_size
        keys = session.keys(min(full, len(req.blocks)))
        self._chains[session.session_id] = keys
        critical = req.priority == 0
        self._critical[session.session_id] = critical
        if critical and keys and req.next_tool is not None:
            until = self.now + self._expiry(req.next_tool[1] or 0.0)
            self._watch(session.session_id, tuple(keys), until)  # type: ignore[arg-type]
        else:
            self._unwatch(session.session_id)
        chain = self._chain(keys)
        reused = [s for _i, _k, _d, s in reversed(chain) if s is not None]
        if reused:
            self.host.touch(reused)
        nxt = req.next_tool
        if nxt is None and self.policy.uses_events:
            return
        predicted, tool = 0.0, None
        if nxt is not None:
            tool = nxt[0]
            predicted = self.forecaster.predict(session.agent_type, tool, nxt[1] or None).seconds
        view = self._view(chain, predicted, 0.0, session, tool, at_finish=True, announced=nxt is not None)
        plan = self.policy.on_finished(view)
        if plan.action == "offload" and not self.opts.offload:
            plan = Plan("none", "disabled")
        self._count("finish", plan)
        if plan.action == "keep":
            self._hold(
                session.session_id,
                [d for _i, _k, d, _s in chain if d is not None],
                self.now + plan.keep_s,
                rank=self.now + plan.keep_s,
                kind="keep",
            )
        elif plan.action == "offload":
            try:
                self._plan_offload(
                    chain, stall=None, session_id=session.session_id, returns_at=self.now + predicted
                )
            except HostPoolExhausted:
                self.stats["early_save.host_pool_full"] += 1

    def stall_begin(self, session: Session, stall_id: str, tool: str, hint_s: float) -> None:
        fc = self.forecaster.predict(session.agent_type, tool, hint_s or None)
        shared = self._session_stall.get(session.session_id)
        if shared is not None:  # a parallel tool call: it shares the session's stall (as the connector)
            self._join(shared, ToolCall(stall_id, session.agent_type, tool, self.now, fc.seconds))
            return
        keys = tuple(self._chains.get(session.session_id, ()))
        stall = _Stall(stall_id, session, tool, self.now, fc.seconds, keys)
        stall.critical = self._critical.get(session.session_id, False)
        stall.lead_s = (
            self.transfer.estimate("h2d", len(keys) * self.profile.block_bytes) + self.opts.prefetch_margin_s
        )
        self._add_stall(stall)
        self.stats["stalls"] += 1
        self._evaluate(stall)

    def _join(self, stall: _Stall, call: ToolCall) -> None:
        """As the connector's ``_join``: the stall lasts until the last of its calls returns."""
        later = stall.calls.join(call)
        self._call_stall[call.stall_id] = stall
        self.stats["stalls.joined"] += 1
        if not later:
            return
        self._retime(stall)
        if not stall.offloaded and math.isfinite(stall.retry_at):
            stall.retry_s = 0.0
            self._schedule_retry(stall, self.now)

    def _retime(self, stall: _Stall) -> None:
        """As the connector's: return, plan, kept-room window and eviction place follow the calls."""
        stall.predicted_s = stall.calls.returns_at - stall.begin_at
        if stall.offloaded:
            plan = self.planner.retime(stall.stall_id, stall.calls.timings())
            if plan is not None:
                stall.reserve_from, stall.reserve_until = plan.due_at, plan.late_at
        if stall in self._demoted:
            self._demote(stall)

    def _evaluate(self, stall: _Stall) -> None:
        chain = self._chain(stall.keys)
        view = self._view(
            chain,
            stall.predicted_s,
            max(0.0, self.now - stall.begin_at),
            stall.session,
            stall.tool,
            at_finish=False,
            announced=False,
        )
        plan = self.policy.on_stall(view)
        if plan.action == "offload" and not self.opts.offload:
            plan = Plan("none", "disabled")
        first = stall.decision is None
        if not first and plan.reason == "no_blocks":
            stall.retry_at = math.inf
            return
        stall.decision = plan.reason
        if first:
            self.stats[f"stalls.decision.{plan.reason}"] += 1
            self._count("stall", plan)
        sid = stall.session.session_id
        if plan.action == "keep":
            self._hold(
                sid,
                [d for _i, _k, d, _s in chain if d is not None],
                self.now + plan.keep_s,
                rank=self.now + plan.keep_s,
                kind="keep",
            )
        elif plan.action == "discard" and self.opts.demote:
            self.cache.move(self._chain_blocks(stall, on_host_only=False, first_in_line=True), front=True)
        if plan.action != "offload":
            if plan.retry:
                base = self.opts.reevaluate_s
                cap = max(self.opts.reevaluate_max_s, base)
                stall.retry_s = min(max(stall.retry_s * 2, base), cap)
                self._schedule_retry(stall, self.now + stall.retry_s)
            else:
                stall.retry_at = math.inf
            return
        stall.evict_first = plan.evict_first
        try:
            elapsed = max(0.0, self.now - stall.begin_at)
            left = remaining_s(stall.predicted_s, elapsed, self.gate.overdue_factor)
            self._plan_offload(chain, stall=stall, session_id=sid, returns_at=self.now + left)
        except HostPoolExhausted:
            stall.decision = "host_pool_full"
            self._schedule_retry(stall, self.now + self.opts.reevaluate_s)
            return
        stall.retry_at = math.inf
        for _i, _k, _d, slot in chain:
            if slot is not None:
                self.host.pin(slot, stall.stall_id)
        stall.offloaded = True
        assert self.engine is not None
        planned = self.planner.begin(
            stall.stall_id,
            sid,
            stall.predicted_s,
            self.transfer.estimate("h2d", len(chain) * self.profile.block_bytes),
            key=f"{stall.session.agent_type}/{stall.tool}",
            wait_s=self.engine.step_wait_s(),
            now=stall.begin_at,
            mode=plan.prefetch,
        )
        if stall.calls.shared:
            planned = self.planner.retime(stall.stall_id, stall.calls.timings()) or planned
        stall.reserve_from, stall.reserve_until = planned.due_at, planned.late_at
        if not self._offload_pending(stall):
            self._demote(stall)

    def stall_end(self, stall_id: str, duration_s: float) -> None:
        stall = self._call_stall.pop(stall_id, None)
        call = stall.calls.leave(stall_id) if stall is not None else None
        if stall is None or call is None:
            return
        self.policy.observe_stall_end(call.key, duration_s)
        self.forecaster.observe(call.agent_type, call.tool, duration_s, call.predicted_s)
        if stall.calls.shared and self.planner.is_open(stall.stall_id):
            self.planner.observe_return(call.key, call.begin_at, call.predicted_s, self.now)
        if stall.calls.open:  # another call of the session still runs
            self._retime(stall)
            return
        self._pop_stall(stall.stall_id)
        sid = stall.session.session_id
        stall.ended_at = self.now
        held = self._holds.get(sid)
        if held is not None:
            held.until = min(held.until, self.now + self.opts.keep_after_end_s)
        self._last_stall[sid] = stall
        self._promote(stall)
        plan = self.planner.get(stall.stall_id)
        if plan is not None:
            if plan.state == "on_device" and not stall.topup and not self._chain_on_device(stall):
                self.planner.mark_evicted(stall.stall_id, now=self.now, retry=False)
            self.planner.end(stall.stall_id, now=self.now, learn=not stall.calls.shared)

    def _chain_on_device(self, stall: _Stall) -> bool:
        dev = self.cache.by_key
        missing = [k for k in stall.keys if k not in dev]
        return not missing or all(s is None for s in self.host.lookup_many(missing))

    # ------------------------------------------------------------------ per step
    def tick(self, now: float) -> None:
        assert self.engine is not None
        for sid, held in list(self._holds.items()):
            if held.until <= now:
                self._unhold(sid, "ttl")
        if self._holds:
            floor = max(self._reserve(), len(self.engine.running))
            self._release_holds_until(lambda: self.cache.num_free >= floor, "reserve")
        waiting = bool(self.engine.waiting)
        if waiting and not self._was_waiting:
            # Requests started waiting: every backed-off stall is asked at once, then at the
            # server's pace again.
            for stall in self._stalls.values():
                if stall.retry_s > self.opts.reevaluate_s and math.isfinite(stall.retry_at):
                    stall.retry_s = 0.0
                    self._schedule_retry(stall, now)
        self._was_waiting = waiting
        heap = self._retries
        while heap and heap[0][0] <= now:
            at, _n, stall = heapq.heappop(heap)
            if stall.retry_at == at and stall.stall_id in self._stalls:
                if waiting:
                    stall.retry_s = 0.0
                self._evaluate(stall)
        self._returning = self._reserve_returns(now)
        if self.opts.prefetch:
            # Prefetched chains can only have been lost if something was evicted since last time.
            evicted, self._seen_evictions = self.cache.evictions != self._seen_evictions, self.cache.evictions
            for stall in list(self._prefetched_running) if evicted else ():
                plan = self.planner.get(stall.stall_id)
                if plan is None or plan.state != "on_device" or plan.ended_at is not None:
                    self._prefetched_running.pop(stall, None)
                elif not stall.topup and not self._chain_on_device(stall):
                    self._prefetched_running.pop(stall, None)
                    self.planner.mark_evicted(stall.stall_id, now=now)
            for stall_id in self.planner.due(now):
                stall = self._stalls.get(stall_id) or self._last_stall.get(self._session_of(stall_id))
                if stall is None or stall.stall_id != stall_id:
                    self.planner.cancel(stall_id, "stall_forgotten")
                    continue
                self._try_prefetch(stall)
            for stall in list(self._topups):
                self._try_topup(stall)
        self._short_pass = False  # the step after the pass that set it is over
        for stall_id in self.planner.expired(now):
            self._pop_stall(stall_id)
            self.host.release(stall_id)

    def _schedule_retry(self, stall: _Stall, at: float) -> None:
        stall.retry_at = at
        heapq.heappush(self._retries, (at, next(self._retry_seq), stall))

    def _session_of(self, stall_id: str) -> str:
        plan = self.planner.get(stall_id)
        return plan.session_id if plan is not None else ""

    def _try_topup(self, stall: _Stall) -> None:
        """As the connector: the rest of a partly uploaded chain, once room frees, while its
        request has not come (then its own demand load brings the rest)."""
        plan = self.planner.get(stall.stall_id)
        if (
            plan is None
            or plan.state not in ("prefetching", "on_device")
            or plan.waiting_since is not None
            or stall.accounted
            or stall.resumed
        ):
            self._topups.pop(stall, None)  # ``stall.topup`` stays: what the request found
        elif plan.state == "on_device" and stall.prefetch_job is None:
            self._try_prefetch(stall, topup=True)

    def _try_prefetch(self, stall: _Stall, *, topup: bool = False) -> None:
        assert self.engine is not None
        self._promote(stall)
        if self._offload_pending(stall):
            return
        # The connector's walk (device hit → count it if idle; else host copy → upload it; else
        # stop), done in cheap passes with the same outcome: what is missing on device (dict
        # lookups), an upper bound of the budget (own idle blocks only lower it), then the host.
        keys, by_key, ref = stall.keys, self.cache.by_key, self.cache.ref
        missing = [(i, k) for i, k in enumerate(keys) if k not in by_key]
        if not missing or self.host.lookup(missing[0][1]) is None:  # type: ignore[arg-type]
            if topup:
                self._topups.pop(stall, None)
                stall.topup = False
                return
            self.planner.mark_started(stall.stall_id, now=self.now)
            self.planner.mark_done(stall.stall_id, now=self.now)
            self.stats["prefetch.not_needed"] += 1
            return
        bound = self.cache.num_free - self._keep_free(
            ahead_of_queue=stall.session.session_id in self._returning
        )
        if bound <= 0:
            stall.deferred += not topup
            return
        need = []
        stop = len(keys)
        for (i, k), slot in zip(missing, self.host.lookup_many([k for _i, k in missing]), strict=True):
            if slot is None:
                stop = i
                break
            need.append((i, k, slot))
        own_idle = sum(1 for k in keys[:stop] if k in by_key and ref[by_key[k]] == 0)
        budget = bound - own_idle
        if budget <= 0:
            stall.deferred += not topup
            return
        stall.topup = len(need) > budget
        if stall.topup:
            need = need[:budget]
            self.stats["prefetch.partial" if not topup else "prefetch.topup_partial"] += 1
            self._topups[stall] = None
        else:
            self._topups.pop(stall, None)
        if topup:
            self.stats["prefetch.topups"] += 1
        blocks = self.cache.allocate(len(need))
        job = self._new_job(
            "prefetch",
            [k for _i, k, _s in need],
            [i for i, _k, _s in need],
            blocks,
            [s for _i, _k, s in need],
            stall=stall,
            session_id=stall.session.session_id,
        )
        self.host.pin_many(job.slots, job.owner)
        stall.prefetch_job = job
        if self.profile.copies_async:
            self._loading_sessions[stall.session.session_id] = job
        self.planner.mark_started(stall.stall_id, now=self.now)

    def next_wake(self) -> float | None:
        """When an idle engine next has something to do for the extension (the real one is woken)."""
        first_due = self.planner.due(math.inf)[:1]
        plan = self.planner.get(first_due[0]) if first_due else None
        times = [plan.due_at] if plan is not None else []
        times += [self._retries[0][0]] if self._retries else []
        times += [h.until for h in self._holds.values()]
        times += [j.done_at for j in self._jobs]
        times = [t for t in times if math.isfinite(t)]
        return max(min(times), self.now) if times else None

    def summary(self) -> dict[str, Any]:
        c = self.stats
        eligible = c["readiness.eligible"]
        ready = c["readiness.prefetched"] + c["readiness.not_needed"] + c["readiness.loading"]
        prefix = c["next_turn.prefix_tokens"]
        return {
            "offloaded_blocks": c["offload.blocks"],
            "uploaded_blocks": c["prefetch.blocks"] + c["load.blocks"],
            "demand_loads": c["demand_load.requests"],
            "next_turn_recomputed_share": c["next_turn.prefix_tokens_recomputed"] / prefix
            if prefix
            else None,
            "ready_rate": ready / eligible if eligible else None,
            "critical_inversions": c["spatial.critical_inversions"],
            "critical_inversions_unsaved": c["spatial.critical_inversions_unsaved"],
            "critical_inversions_late": c["spatial.critical_inversions_late"],
            "critical_recomputed_share": c["next_turn.critical.prefix_tokens_recomputed"]
            / c["next_turn.critical.prefix_tokens"]
            if c["next_turn.critical.prefix_tokens"]
            else None,
            "counters": dict(sorted(c.items())),
            "host_pool": self.host.stats(),
            "prefetch_planner": self.planner.stats(),
        }
