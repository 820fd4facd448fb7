"""Hostile clients against a running TokenCake server's events listener, as an operator would try it.

Starts nothing: point it at a server started with a key (``TOKENCAKE_API_KEY=... tokencake serve``)
and pass the same key in the environment. It sends ~2,000 hostile event payloads (oversized,
deeply nested, NaN / 1e999 numbers, random bytes, unknown sessions, replays, wrong or no key),
then holds a 1 byte/s client and 600 idle keyless sockets while a keyed keep-alive client keeps
sending, and checks:

* no 5xx for any payload; the slow client is cut at the listener's request deadline;
* the keyed client's connection is never shed by the keyless sockets;
* vLLM's greedy answer is the same before, during and after;
* EngineCore's RSS (the listener lives there) before and after;
* the key is in no process's argv, not in the log, not in ``/v1/stats``.

    TOKENCAKE_API_KEY=... python benchmarks/hostile_events.py --port 8000 \
        --log ~/.cache/tokencake/logs/vllm-tokencake-8000.log

Prints one JSON document; exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

BEGIN = {"type": "stall_begin", "stall_id": "h-1", "session_id": "run:h", "run_id": "run", "node": "a",
         "tool": "search", "predicted_s": 2.0, "ts": 1.0}  # fmt: skip
END = {"type": "stall_end", "stall_id": "h-1", "session_id": "run:h", "run_id": "run", "node": "a",
       "tool": "search", "duration_s": 1.5, "ts": 2.5}  # fmt: skip


def payloads(rng: random.Random, key: str) -> list[tuple[str, bytes, dict[str, str]]]:
    """(kind, body, headers) for every hostile request."""
    auth = {"Authorization": f"Bearer {key}"}
    out: list[tuple[str, bytes, dict[str, str]]] = []
    for i in range(300):
        doc: dict[str, Any] = dict(rng.choice([BEGIN, END]))
        doc[rng.choice([*doc, "extra"])] = rng.choice(
            [None, -1, 1e308, "x" * rng.randint(0, 300), [], {}, True]
        )
        doc["stall_id"] = f"mut-{i}"
        out.append(("mutated", json.dumps(doc).encode(), auth))
    out += [("random bytes", bytes(rng.randrange(256) for _ in range(rng.randint(1, 256))), auth)
            for _ in range(300)]  # fmt: skip
    out += [("oversized", b"{" + b" " * rng.randint(64 * 1024, 1 << 20) + b"}", auth) for _ in range(200)]
    out += [("deep json", b"[" * rng.randint(1000, 60000) + b"]" * 3, auth) for _ in range(100)]
    out += [("deep json", (b'{"a":' * rng.randint(1000, 30000)) + b"1" + b"}" * 10, auth) for _ in range(100)]
    for i in range(200):
        text = json.dumps({**BEGIN, "stall_id": f"num-{i}"}).replace(
            '"predicted_s": 2.0', f'"predicted_s": {rng.choice(["NaN", "Infinity", "-Infinity", "1e999"])}'
        )
        out.append(("NaN/1e999", text.encode(), auth))
    out += [("unknown session", json.dumps({**BEGIN, "stall_id": f"u-{i}", "session_id": f"run:ghost-{i}"})
             .encode(), auth) for i in range(300)]  # fmt: skip
    replay = json.dumps({**BEGIN, "stall_id": "replayed"}).encode()
    out += [("replay", replay, auth) for _ in range(150)]
    out += [("replay", json.dumps({**END, "stall_id": "replayed"}).encode(), auth) for _ in range(150)]
    out += [("wrong key", replay, {"Authorization": "Bearer wrong"}) for _ in range(200)]
    out += [("no key", replay, {}) for _ in range(75)]
    return out


def greedy(base_url: str, key: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "The capital of France is"}],
            "max_tokens": 12, "temperature": 0.0}  # fmt: skip
    r = httpx.post(
        base_url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300
    )
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def group_of(port: int) -> list[int]:
    """pids of the processes whose argv names ``--port PORT`` and their process group."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    leaders = set()
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
                leaders.add(os.getpgid(pid))
        except (OSError, IndexError):
            continue
    return [pid for pid in pids if _pgid(pid) in leaders]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def engine_core(pids: list[int]) -> int | None:
    for pid in pids:
        try:
            if (
                "EngineCore" in Path(f"/proc/{pid}/comm").read_text()
                or b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes()
            ):
                return pid
        except OSError:
            continue
    return None


def slow_client(host: str, port: int, limit_s: float = 40.0) -> float:
    """Seconds until the listener closed a client sending one byte a second."""
    request = b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n\r\n" + b" " * 200
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=5) as sock:
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
                sock.settimeout(1.0)
                if sock.recv(1, socket.MSG_PEEK) == b"":
                    break
            except TimeoutError:
                pass
            except OSError:
                break
            if time.monotonic() - t0 > limit_s:
                break
    return time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the server's OpenAI port (events: + 1)")
    parser.add_argument("--log", type=Path, help="the server's log (checked for the key)")
    parser.add_argument("--seed", type=int, default=49)
    args = parser.parse_args()
    key = os.environ.get("TOKENCAKE_API_KEY", "")
    if not key:
        sys.exit("set TOKENCAKE_API_KEY to the server's key")
    base = f"http://{args.host}:{args.port}/v1"
    events = f"http://{args.host}:{args.port + 1}"
    auth = {"Authorization": f"Bearer {key}"}
    model = httpx.get(base + "/models", headers=auth, timeout=30).json()["data"][0]["id"]
    pids = group_of(args.port)
    core = engine_core(pids)
    out: dict[str, Any] = {"processes": len(pids), "engine_core": core}
    rss_before = rss_kib(core) if core else 0
    answers = {"before": greedy(base, key, model)}

    statuses: dict[str, Counter[int]] = {}
    with httpx.Client(base_url=events, timeout=30) as client:
        for kind, body, headers in payloads(random.Random(args.seed), key):
            try:
                code = client.post("/v1/events", content=body, headers=headers).status_code
            except httpx.HTTPError:
                code = 0  # closed on us (an oversized body)
            statuses.setdefault(kind, Counter())[code] += 1
    out["payloads"] = sum(sum(c.values()) for c in statuses.values())
    out["statuses"] = {k: dict(sorted(c.items())) for k, c in statuses.items()}
    out["5xx"] = sum(n for c in statuses.values() for code, n in c.items() if code >= 500)

    slow_s = slow_client(args.host, args.port + 1)  # alone: with idle sockets it would be shed first
    keyed = httpx.Client(base_url=events, timeout=10, headers=auth)
    keyed_ok = keyed.post("/v1/events", json={**BEGIN, "stall_id": "keyed-0"}).status_code == 200
    idle = []
    for _ in range(600):
        try:
            idle.append(socket.create_connection((args.host, args.port + 1), timeout=5))
        except OSError:
            break
    answers["during"] = greedy(base, key, model)
    kept = 0
    for i in range(1, 21):
        kept += keyed.post("/v1/events", json={**BEGIN, "stall_id": f"keyed-{i}"}).status_code == 200
    stats = keyed.get("/v1/stats").json()
    for sock in idle:
        sock.close()
    keyed.close()
    answers["after"] = greedy(base, key, model)
    counters = stats.get("event_api", {}).get("counters", {})
    out.update(
        idle_sockets=len(idle),
        shed=counters.get("connections.shed", 0),
        shed_trusted=counters.get("connections.shed_trusted", 0),
        timed_out=counters.get("connections.timed_out", 0),
        keyed_client_served=f"{kept + keyed_ok} of 21",
        slow_client_closed_after_s=round(slow_s, 1),
        answers=answers,
    )
    rss_after = rss_kib(core) if core else 0
    out["engine_core_rss_kib"] = [rss_before, rss_after]
    out["rss_change_pct"] = round(100.0 * (rss_after - rss_before) / rss_before, 2) if rss_before else None
    in_argv = [p for p in group_of(args.port) if key.encode() in Path(f"/proc/{p}/cmdline").read_bytes()]
    out["key_in_argv"] = in_argv
    out["key_in_log"] = bool(args.log and key in args.log.read_text(errors="replace"))
    out["key_in_stats"] = key in json.dumps(stats)
    checks = {
        "no 5xx": out["5xx"] == 0,
        "same greedy answer": len(set(answers.values())) == 1,
        "keyed connection never shed": out["shed_trusted"] == 0 and kept == 20,
        "slow client cut at the deadline": 5 < slow_s < 30 and out["timed_out"] >= 1,
        "key nowhere": not in_argv and not out["key_in_log"] and not out["key_in_stats"],
    }
    out["checks"] = checks
    print(json.dumps(out, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
