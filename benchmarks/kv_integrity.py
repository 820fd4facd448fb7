"""KV integrity under load: does TokenCake ever serve an answer stock vLLM would not?

Many multi-turn sessions with random stall lengths, some sharing a long system-prompt prefix, run
concurrently against a TokenCake server with a small device KV cache (offloads, demotion, prefetch
and demand loads all happen). The same workload then runs against a stock vLLM server with the same
small cache (the **control**: stock vLLM also recomputes evicted prefixes, and greedy outputs can
differ between a prefix hit and a full prefill). Afterwards every request of both runs is replayed
alone, in its session's order, on a **reference** stock server, and each reply is compared with the
reference's. TokenCake must not mismatch more often than the control. Exit status 1 if it does (or
if a request failed), 0 otherwise.

    # start its own servers (one at a time: TokenCake, then stock for control + reference), ~1 h at full size
    .venv/bin/python benchmarks/kv_integrity.py
    # a quick check (~10 min on 2 cores)
    .venv/bin/python benchmarks/kv_integrity.py --small
    # against running servers (the reference defaults to the control server)
    .venv/bin/python benchmarks/kv_integrity.py --base-url http://127.0.0.1:8000/v1 \\
        --events-url http://127.0.0.1:8001 --control-url http://127.0.0.1:8100/v1 \\
        [--reference-url http://127.0.0.1:8200/v1] [--api-key KEY]
    # with copy faults injected into the TokenCake server it starts
    .venv/bin/python benchmarks/kv_integrity.py --small --faults "copy_fail=0.3,copy_stall_s=0.5,seed=1"

Prints a table and one JSON line (``--json PATH`` also writes it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

WORDS = (
    "amber basil cedar dune ember fjord grove heath inlet juniper kelp larch moss nectar orchid pine "
    "quartz reed sage thistle umber vale willow yarrow zinnia river stone market garden engine signal "
    "harbor winter copper lantern orbit ledger canyon meadow archive valve circuit tunnel glacier"
).split()


@dataclass(frozen=True)
class Workload:
    """Seeded sessions: who shares which prefix, every question and every stall length."""

    sessions: int
    turns: int
    groups: int
    shared_words: int
    private_words: int
    stall_s: tuple[float, float]
    concurrency: int
    max_tokens: int
    seed: int


@dataclass
class Turn:
    messages: list[dict[str, str]]
    text: str | None = None
    error: str | None = None
    #: Where the server says this request's prompt KV came from (TokenCake's response
    #: ``kv_transfer_params.tokencake_kv``; None from stock vLLM).
    kv: dict[str, int] | None = None


@dataclass
class Session:
    index: int
    session_id: str
    turns: list[Turn] = field(default_factory=list)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(w: Workload, i: int) -> str:
    """Sessions of one group share a long prefix; each adds a private document."""
    group = i % w.groups
    shared = _words(random.Random(f"{w.seed}-group-{group}"), w.shared_words)
    private = _words(random.Random(f"{w.seed}-session-{i}"), w.private_words)
    return f"Team {group} brief: {shared}\nYour own notes (agent {i}): {private}"


def stall_lengths(w: Workload) -> list[list[float]]:
    rng = random.Random(f"{w.seed}-stalls")
    return [[rng.uniform(*w.stall_s) for _ in range(w.turns)] for _ in range(w.sessions)]


class Client:
    """One OpenAI-compatible server (and its events URL, for TokenCake)."""

    def __init__(self, base_url: str, events_url: str | None, api_key: str | None, model: str | None) -> None:
        self.base_url, self.events_url = base_url.rstrip("/"), events_url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=600.0)
        self.model = model or self.http.get(self.base_url + "/models").json()["data"][0]["id"]

    def chat(
        self, messages: list[dict[str, str]], max_tokens: int, meta: dict[str, Any] | None
    ) -> tuple[str, dict[str, int] | None]:
        """The reply and, from TokenCake, where its prompt KV came from."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        if meta is not None:
            body["kv_transfer_params"] = {"tokencake": meta}
        resp = self.http.post(self.base_url + "/chat/completions", json=body)
        resp.raise_for_status()
        data = resp.json()
        kv = (data.get("kv_transfer_params") or {}).get("tokencake_kv")
        return str(data["choices"][0]["message"]["content"]), kv if isinstance(kv, dict) else None

    def event(self, kind: str, **fields: Any) -> None:
        if self.events_url is None:
            return
        with contextlib.suppress(httpx.HTTPError):  # events never fail a session (as in the SDK)
            self.http.post(self.events_url + "/v1/events", json={"type": kind, "ts": time.time(), **fields})

    def stats(self) -> dict[str, Any]:
        if self.events_url is None:
            return {}
        try:
            return dict(self.http.get(self.events_url + "/v1/stats").json())
        except (httpx.HTTPError, ValueError):
            return {}


def run_workload(client: Client, w: Workload, label: str) -> list[Session]:
    """All sessions concurrently (``w.concurrency`` at a time); each turn's reply is recorded."""
    run_id = f"{label}-{uuid.uuid4().hex[:6]}"
    stalls = stall_lengths(w)
    sessions = [Session(i, f"{run_id}:s{i}") for i in range(w.sessions)]

    def one(s: Session) -> None:
        messages = [
            {"role": "system", "content": system_prompt(w, s.index)},
            {"role": "user", "content": f"Question 0 for agent {s.index}: name one word from your notes."},
        ]
        for t in range(w.turns):
            stall = stalls[s.index][t]
            last = t == w.turns - 1
            meta = {
                "session_id": s.session_id,
                "run_id": run_id,
                "node": f"s{s.index}",
                "agent_type": "integrity",
                "turn": t,
                "next_stall": None if last else {"tool": "search", "predicted_s": round(stall, 2)},
            }
            turn = Turn(list(messages))
            s.turns.append(turn)
            try:
                turn.text, turn.kv = client.chat(turn.messages, w.max_tokens, meta)
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                turn.error = f"{type(exc).__name__}: {exc}"
                return
            if last:
                return
            ids = {"stall_id": f"{s.session_id}-t{t}", "session_id": s.session_id, "run_id": run_id}
            ids["node"] = f"s{s.index}"
            client.event("stall_begin", **ids, tool="search", agent_type="integrity", predicted_s=stall)
            time.sleep(stall)
            client.event("stall_end", **ids, tool="search", duration_s=stall)
            messages += [
                {"role": "assistant", "content": turn.text},
                {
                    "role": "user",
                    "content": f"Tool result {t}: {_words(random.Random(s.session_id), 12)}. "
                    f"Question {t + 1}: one more word?",
                },
            ]

    with ThreadPoolExecutor(max_workers=w.concurrency) as pool:
        list(pool.map(one, sessions))
    return sessions


def source(kv: dict[str, int] | None) -> str:
    """The class of where a request's prompt KV came from (the most suspect source first)."""
    if kv is None:
        return "no_record"
    if kv.get("failed_load_tokens", 0) > 0 or kv.get("failed_copy_tokens", 0) > 0:
        return "failed_copy"  # its own load failed (recomputed), or its session's offload/prefetch
    if kv.get("admissions", 1) > 1:
        return "preempted"
    if kv.get("host_tokens", 0) > 0:
        return "host_load"
    if kv.get("prefetched_tokens", 0) > 0:
        return "prefetched"
    if kv.get("copied_tokens", 0) > 0:
        return "copied_hit"  # a device hit on blocks another session's copy wrote (a shared prefix)
    return "device_hit" if kv.get("device_tokens", 0) > 0 else "computed"


def by_source(
    sessions: list[Session], mismatched: list[str], only_here: list[str]
) -> dict[str, dict[str, int]]:
    """Turns, mismatches and mismatches on this system only, per KV source class."""
    out: dict[str, dict[str, int]] = {}
    bad, own = set(mismatched), set(only_here)
    for s in sessions:
        for t, turn in enumerate(s.turns):
            if turn.text is None:
                continue
            row = out.setdefault(source(turn.kv), {"turns": 0, "mismatches": 0, "only_here": 0})
            key = f"{s.session_id.rsplit(':', 1)[-1]}/t{t}"
            row["turns"] += 1
            row["mismatches"] += key in bad
            row["only_here"] += key in own
    return dict(sorted(out.items()))


def replay(
    reference: Client, sessions: list[Session], max_tokens: int
) -> tuple[int, int, list[str], list[str]]:
    """Each session's turns alone, in order, on the reference.

    Returns (compared, mismatches, examples, mismatched turns as ``"s<i>/t<turn>"``): the same
    workload runs on both systems, so a turn that mismatches on both is the batch-vs-alone float
    order of that request, not something one system did.
    """
    compared = mismatches = 0
    examples: list[str] = []
    where: list[str] = []
    for s in sessions:
        for t, turn in enumerate(s.turns):
            if turn.text is None:
                continue
            ref, _ = reference.chat(turn.messages, max_tokens, None)
            compared += 1
            if ref != turn.text:
                mismatches += 1
                where.append(f"{s.session_id.rsplit(':', 1)[-1]}/t{t}")
                if len(examples) < 10:
                    examples.append(f"{s.session_id} turn {t}: got {turn.text!r}, reference {ref!r}")
    return compared, mismatches, examples, where


@contextlib.contextmanager
def server(args: argparse.Namespace, *, baseline: bool, name: str) -> Iterator[Any]:
    """Start a vLLM server (TokenCake or stock) with the small device cache; stopped on exit."""
    from tokencake.serving import Server

    env = {"TOKENCAKE_FAULTS": args.faults} if args.faults and not baseline else None
    log = Path(args.log_dir) / f"kv-integrity-{name}.log"
    srv = Server(
        baseline=baseline,
        num_gpu_blocks=args.device_blocks,
        max_model_len=args.max_model_len,
        env=env,
        log_file=log,
        progress=True,
    )
    with srv:
        yield srv


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="running TokenCake server (OpenAI base URL, .../v1)")
    p.add_argument("--events-url", help="its events URL (default: base port + 1)")
    p.add_argument("--control-url", help="running stock vLLM with the same small cache")
    p.add_argument("--reference-url", help="running stock vLLM for the replays (default: the control)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--small", action="store_true", help="a quick check: 6 sessions x 3 turns")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--groups", type=int, default=4, help="sessions per shared prefix = sessions / groups")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--stall-min", type=float, default=0.5)
    p.add_argument("--stall-max", type=float, default=12.0)
    p.add_argument("--device-blocks", type=int, default=40, help="device KV blocks of the servers it starts")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--faults", default=None, help="TOKENCAKE_FAULTS for the TokenCake server it starts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="bench-out/kv-integrity")
    p.add_argument("--json", default=None, help="also write the JSON summary here")
    args = p.parse_args(argv)
    if args.small:
        args.sessions, args.turns, args.groups, args.concurrency = 6, 3, 2, 3
        args.stall_min, args.stall_max = 0.5, 4.0
    w = Workload(
        sessions=args.sessions,
        turns=args.turns,
        groups=max(1, args.groups),
        shared_words=300,
        private_words=250,
        stall_s=(args.stall_min, args.stall_max),
        concurrency=args.concurrency,
        max_tokens=8,
        seed=args.seed,
    )
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    from tokencake.bench.environment import versions

    env = versions()
    result: dict[str, Any] = {
        "workload": w.__dict__ | {"stall_s": list(w.stall_s)},
        "git_commit": env.get("git_commit"),
        "git_dirty": env.get("git_dirty"),
    }

    # 1. TokenCake
    with contextlib.ExitStack() as stack:
        if args.base_url:
            events = args.events_url or _events_url(args.base_url)
            tc_client = Client(args.base_url, events, args.api_key, args.model)
        else:
            srv = stack.enter_context(server(args, baseline=False, name="tokencake"))
            tc_client = Client(srv.base_url, srv.events_url, None, srv.model)
        before = tc_client.stats()
        tc_sessions = run_workload(tc_client, w, "tokencake")
        time.sleep(2.0)
        result["tokencake_stats"] = _stats_delta(before, tc_client.stats())

    # 2. Control (stock, same small cache), then the replays on the reference.
    with contextlib.ExitStack() as stack:
        if args.control_url:
            control = Client(args.control_url, None, args.api_key, args.model)
        else:
            srv = stack.enter_context(server(args, baseline=True, name="stock"))
            control = Client(srv.base_url, None, None, srv.model)
        ctl_sessions = run_workload(control, w, "control")
        reference = (
            Client(args.reference_url, None, args.api_key, args.model) if args.reference_url else control
        )
        rows = {}
        for label, sessions in (("tokencake", tc_sessions), ("control", ctl_sessions)):
            compared, mismatches, examples, where = replay(reference, sessions, w.max_tokens)
            errors = [t.error for s in sessions for t in s.turns if t.error]
            rows[label] = {
                "requests": sum(len(s.turns) for s in sessions),
                "compared": compared,
                "mismatches": mismatches,
                "errors": len(errors),
                "error_examples": errors[:3],
                "mismatch_examples": examples,
                "mismatched_turns": where,
            }
    both = set(rows["tokencake"]["mismatched_turns"]) & set(rows["control"]["mismatched_turns"])
    for label, sessions in (("tokencake", tc_sessions), ("control", ctl_sessions)):
        rows[label]["only_here"] = sorted(set(rows[label]["mismatched_turns"]) - both)
        rows[label]["by_kv_source"] = by_source(
            sessions, rows[label]["mismatched_turns"], rows[label]["only_here"]
        )
    result["results"] = rows
    # Paired (McNemar, exact): the same requests ran on both, so only the turns that mismatched on
    # one system say anything about a difference. p = P(TokenCake-only >= observed | equal rates).
    b, c = len(rows["tokencake"]["only_here"]), len(rows["control"]["only_here"])
    tail = sum(math.comb(b + c, k) for k in range(b, b + c + 1))
    result["mcnemar_one_sided_p"] = round(tail / 2 ** (b + c), 4)
    result["seconds"] = round(time.monotonic() - t0, 1)
    ok = (
        rows["tokencake"]["mismatches"] <= rows["control"]["mismatches"]
        and rows["tokencake"]["errors"] == 0
        and rows["tokencake"]["compared"] > 0
    )
    result["ok"] = ok
    print(f"{'system':<10} {'requests':>9} {'compared':>9} {'mismatches':>11} {'errors':>7}")
    for label, row in rows.items():
        counts = (row["requests"], row["compared"], row["mismatches"], row["errors"])
        print(f"{label:<10} {counts[0]:>9} {counts[1]:>9} {counts[2]:>11} {counts[3]:>7}")
        for line in row["mismatch_examples"] + row["error_examples"]:
            print(f"  {line}")
    print(
        f"mismatched on both systems (the request's batch-vs-alone numerics): {len(both)}; "
        f"only on TokenCake: {rows['tokencake']['only_here']}; only on stock: {rows['control']['only_here']}"
        f" (paired exact test, one-sided p = {result['mcnemar_one_sided_p']})"
    )
    print("tokencake by KV source (turns / mismatches / only on TokenCake):")
    for cls, row in rows["tokencake"]["by_kv_source"].items():
        print(f"  {cls:<11} {row['turns']:>5} {row['mismatches']:>5} {row['only_here']:>5}")
    counters = result["tokencake_stats"]
    print("tokencake copies:", {k: v for k, v in sorted(counters.items()) if _interesting(k)})
    print("OK" if ok else "FAIL: TokenCake mismatched more often than stock vLLM (or a request failed)")
    line = json.dumps(result, default=str)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0 if ok else 1


def _events_url(base_url: str) -> str:
    url = httpx.URL(base_url)
    return f"{url.scheme}://{url.host}:{(url.port or 80) + 1}"


def _stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    b, a = before.get("counters", {}), after.get("counters", {})
    return {k: v - b.get(k, 0) for k, v in a.items() if isinstance(v, (int, float)) and v != b.get(k, 0)}


def _interesting(name: str) -> bool:
    return name.split(".")[0] in ("offload", "prefetch", "load", "demand_load", "jobs", "errors") or (
        name.startswith("next_turn.")
    )


if __name__ == "__main__":
    sys.exit(main())
