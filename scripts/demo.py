"""The README's first command (``make demo``): a real agent app on a real LLM, start to finish.

Starts vLLM + the TokenCake extension with the bundled SmolLM2-135M (``tokencake.serving.Server``
as a context manager), runs the app of ``examples/quickstart.py`` against it through the SDK,
prints the app's answer, the per-node timings and what the server saw, then stops the server.

    python scripts/demo.py [--city Lisbon] [--baseline] [--port 0] [--example examples/quickstart.py]
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

import tokencake as tc
from tokencake.serving import ModelError, Server, ServerError

ROOT = Path(__file__).resolve().parent.parent


def load_app(path: Path) -> tc.App:
    """The ``app`` defined by an example module (run without its ``__main__`` block)."""
    namespace = runpy.run_path(str(path), run_name="tokencake_example")
    app = namespace.get("app")
    if not isinstance(app, tc.App):
        raise SystemExit(f"demo: {path} defines no `app = tc.App(...)`")
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", type=Path, default=ROOT / "examples" / "quickstart.py")
    parser.add_argument("--city", default="Lisbon", help="the quickstart app's input")
    parser.add_argument("--model", help="HF model directory or hub id (default: bundled SmolLM2)")
    parser.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    parser.add_argument("--baseline", action="store_true", help="stock vLLM, no extension")
    args = parser.parse_args(argv)

    app = load_app(args.example)
    inputs = {name: args.city for name in app.inputs}
    started = time.monotonic()
    try:
        with Server(args.model, port=args.port, baseline=args.baseline, progress=True) as srv:
            print(f"server ready in {srv.startup_s:.0f} s at {srv.base_url} (model {srv.model})", flush=True)
            llm = tc.LLM(srv.base_url, srv.model, events_url=srv.events_url or False)
            try:
                result = app.run_sync(llm=llm, timeout=600, **inputs)
            except tc.NodeFailed as exc:
                print(f"demo: the app failed: {exc}", file=sys.stderr)
                return 1
            print(f"\n=== {app.name}: answer ===\n{result.output}\n")
            print(f"=== per-node timings (wall {result.wall_s:.1f} s) ===\n{result.timings_table()}\n")
            if srv.events_url:
                counters = srv.stats().get("counters", {})
                seen = {k: counters.get(k, 0) for k in ("requests.with_meta", "events.stall_begin")}
                print(f"=== server side === {seen}")
            print("stopping the server …", flush=True)
    except (ServerError, ModelError) as exc:
        tail = getattr(exc, "log_tail", "")
        if tail:
            print(tail, file=sys.stderr)
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    print(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
