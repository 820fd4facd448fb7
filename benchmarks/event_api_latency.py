"""Round-trip latency of stall events on loopback: p50/p99 of stall_begin and stall_end acks.

By default it starts an in-process :class:`~tokencake.serving.event_api.EventServer` whose
handler is the real :class:`~tokencake.serving.sessions.SessionTracker` (bookkeeping only, as in
the engine). With ``--url`` it targets a running ``tokencake serve`` events URL instead.

    .venv/bin/python benchmarks/event_api_latency.py -n 2000
    .venv/bin/python benchmarks/event_api_latency.py --url http://127.0.0.1:8001 --api-key KEY

Prints a table and one JSON line (``--json-only`` for just the JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any

import httpx

from tokencake.events import EVENTS_PATH
from tokencake.serving.event_api import EventServer
from tokencake.serving.sessions import SessionTracker
from tokencake.serving.stats import quantile


def summarize(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    ms = [x * 1000 for x in ordered]
    return {
        "n": len(ms),
        "p50_ms": quantile(ms, 0.50),
        "p90_ms": quantile(ms, 0.90),
        "p99_ms": quantile(ms, 0.99),
        "max_ms": ms[-1],
        "mean_ms": sum(ms) / len(ms),
    }


def run(url: str, n: int, warmup: int, api_key: str | None) -> dict[str, Any]:
    """Send ``n`` begin/end pairs over one keep-alive connection; time each POST."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    times: dict[str, list[float]] = {"stall_begin": [], "stall_end": []}
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=url, headers=headers, timeout=10.0) as client:
        for i in range(warmup + n):
            common = {
                "stall_id": f"{run_id}-{i}",
                "session_id": f"{run_id}:agent",
                "run_id": run_id,
                "node": "agent",
                "tool": "search",
            }
            begin = {"type": "stall_begin", "predicted_s": 1.0, "ts": time.time(), **common}
            end = {"type": "stall_end", "duration_s": 0.0, "ts": time.time(), **common}
            for kind, body in (("stall_begin", begin), ("stall_end", end)):
                t0 = time.perf_counter()
                r = client.post(EVENTS_PATH, json=body)
                dt = time.perf_counter() - t0
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if i >= warmup:
                    times[kind].append(dt)
    return {
        "url": url,
        "n": n,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "stall_begin": summarize(times["stall_begin"]),
        "stall_end": summarize(times["stall_end"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=1000, help="begin/end pairs to time (default 1000)")
    p.add_argument("--warmup", type=int, default=50, help="untimed pairs first (default 50)")
    p.add_argument("--url", default=None, help="events URL of a running server (default: in-process)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--json-only", action="store_true")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error("-n must be >= 1")

    server: EventServer | None = None
    url = args.url
    if url is None:
        tracker = SessionTracker()
        server = EventServer("127.0.0.1", 0, tracker.apply, tracker.stats, api_key=args.api_key).start()
        url = server.url
    try:
        result = run(url.rstrip("/"), args.n, args.warmup, args.api_key)
    except httpx.HTTPError as exc:
        print(f"error: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.close()
    result["target"] = "in-process EventServer + SessionTracker" if args.url is None else "external"

    if not args.json_only:
        print(f"event API round trips on {result['url']} ({result['target']}), n={args.n}")
        print(f"{'event':<12} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} {'mean ms':>8}")
        for kind in ("stall_begin", "stall_end"):
            s = result[kind]
            print(
                f"{kind:<12} {s['p50_ms']:>8.3f} {s['p90_ms']:>8.3f} {s['p99_ms']:>8.3f} "
                f"{s['max_ms']:>8.3f} {s['mean_ms']:>8.3f}"
            )
        print(f"HTTP statuses: {result['statuses']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
