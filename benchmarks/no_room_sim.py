"""Why a returning session's chain had no room on device when its next request arrived.

Issue 9 asks that a session's blocks be on device (or loading) when its next request arrives in
≥ 80 % of the stalls longer than the transfer lead. On the CPU stress runs most misses are
``readiness.no_room``: the budget rule (``_keep_free``: the reserve, a block per running request,
the queue's demand) would not have uploaded the chain. This replays each stored real run's trace
(the same apps, tools and arrivals) on the simulator's model of the host they ran on
(``cpu-fast``) with the run's device and host blocks, logs the device at every eligible arrival
(:class:`ArrivalLogCore`, the KV core with a probe), and splits the no-room arrivals by what filled
the device:

* ``chain_exceeds_free``: the chain's missing blocks exceed every free block (evictable cached ones
  included) — no rule could have had it there without preempting a running request;
* ``running_floor``: it fits the free blocks but not beside one block per running request;
* ``queue_demand``: it fits beside the running requests; the queued requests' demand took the room.

    python benchmarks/no_room_sim.py --out docs/bench/sim-no-room.json     # seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from tokencake.bench.environment import versions
from tokencake.serving.kvcore.core import READINESS, KVCore
from tokencake.serving.kvcore.ports import RequestView
from tokencake.sim.presets import from_bench_point
from tokencake.sim.profiles import get_profile
from tokencake.sim.run import simulate
from tokencake.sim.stored import PACKAGED, REPLAYED, read_results

#: The stored runs replayed: their compact copies (``tokencake.sim.stored``; ``--runs`` takes full
#: results files or compact copies).
RUNS: tuple[Traversable, ...] = tuple(PACKAGED / f"{name}.gz" for name in REPLAYED)
CAUSES: tuple[str, ...] = ("chain_exceeds_free", "running_floor", "queue_demand")
#: The runs above ran on the faster host (``tokencake.sim.stored.FIXTURES``).
PROFILE = "cpu-fast"


class ArrivalLogCore(KVCore):
    """The KV core, logging the device's state when a session's next request arrives (after the
    core judged its readiness) and, once the request is accounted, whether it was eligible and
    how ready it was."""

    def __init__(self, *args: Any, log: list[dict[str, Any]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log = log
        self._entries: dict[str, dict[str, Any]] = {}
        self._account = self.readiness.account_next_turn
        self.readiness.account_next_turn = self._account_next_turn  # type: ignore[method-assign]

    def on_new_request(self, request: RequestView) -> None:
        super().on_new_request(request)
        req_id = request.request_id
        info = self.requests.info.get(req_id)
        stall = self.stalls.last.get(info.session_id) if info is not None else None
        if info is None or stall is None or stall.accounted or self.pool is None:
            return
        missing = own_idle = 0
        for h in stall.hashes:
            block = self.pool.cached(h)
            if block is None:
                missing += 1
            else:
                own_idle += block.ref_cnt == 0
        others = [n for r, n in self.requests.waiting.items() if r != req_id]
        entry = {
            "t": self.clock(),
            "room": bool(info.room_at_arrival),
            "chain": len(stall.hashes),
            "missing": missing,
            "free": self.pool.num_free() - own_idle,  # free blocks not of this chain
            "running": self.steps.running,
            "queued": len(others),
            "queued_blocks": sum(others),
            "head_blocks": others[0] if others else 0,
            "keep_free": self.admission.keep_free(exclude=req_id),
            "eligible": False,  # set when the request is accounted (stall longer than its lead)
        }
        self._entries[req_id] = entry
        self.log.append(entry)

    def _account_next_turn(self, request: RequestView, local: int, external: int) -> bool:
        before = {k: self.stats.counter(f"readiness.{k}") for k in READINESS}
        turn = self._account(request, local, external)
        entry = self._entries.pop(request.request_id, None)
        for k in READINESS:
            if entry is not None and self.stats.counter(f"readiness.{k}") > before[k]:
                entry.update(eligible=True, ready=k)
        return turn


def cause(entry: dict[str, Any]) -> str:
    """Which term of the budget left no room for this arrival's missing chain blocks."""
    if entry["missing"] > entry["free"]:
        return "chain_exceeds_free"
    if entry["missing"] > entry["free"] - entry["running"]:
        return "running_floor"
    return "queue_demand"


def _median(entries: list[dict[str, Any]], key: str) -> float | None:
    return statistics.median(e[key] for e in entries) if entries else None


def summarize(entries: list[dict[str, Any]], device_blocks: int) -> dict[str, Any]:
    eligible = [e for e in entries if e["eligible"]]
    no_room = [e for e in eligible if not e["room"]]
    ready = [e for e in eligible if e.get("ready") != "missed"]
    return {
        "device_blocks": device_blocks,
        "eligible": len(eligible),
        "ready_rate": len(ready) / len(eligible) if eligible else None,
        "no_room": len(no_room),
        "no_room_causes": {c: sum(cause(e) == c for e in no_room) for c in CAUSES},
        "no_room_median": {
            k: _median(no_room, k) for k in ("chain", "missing", "free", "running", "queued", "head_blocks")
        },
        "eligible_median": {k: _median(eligible, k) for k in ("chain", "free", "running", "queued")},
    }


def replay(path: Traversable) -> list[dict[str, Any]]:
    """One row per point of the stored run (its first round's trace, as ``tokencake sim --validate``)."""
    results = read_results(path)
    server = results["config"]["server"]
    profile = get_profile(PROFILE)
    rows, seen = [], set()
    for point in results["points"]:
        label = point.get("base_label", point["label"]).split("#")[0]
        if label in seen:
            continue
        seen.add(label)
        log: list[dict[str, Any]] = []
        simulate(
            from_bench_point(point, "baseline"),
            profile,
            "tokencake",
            device_blocks=server["device_blocks"],
            host_blocks=server.get("host_pool_blocks") or profile.host_blocks,
            core_factory=partial(ArrivalLogCore, log=log),
        )
        run = path.name.removesuffix(".gz")
        rows.append({"run": run, "point": label, **summarize(log, server["device_blocks"])})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="*", type=Path, default=list(RUNS))
    ap.add_argument("--out", type=Path, default=Path("sim-no-room.json"))
    args = ap.parse_args()
    rows = [row for path in args.runs for row in replay(path)]
    doc = {
        "kind": "sim-no-room",
        "versions": versions(),
        "profile": PROFILE,
        "system": "tokencake",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
