"""Transparent mode as a new user meets it: one agent per framework, no TokenCake import (issue 48).

Starts one ``tokencake serve``-equivalent server (``Server(port=0)``: the bundled model and default
flags, transparent mode on), runs each program of ``examples/transparent/`` (a plain ``openai`` loop,
OpenAI Agents SDK, LangChain ``create_agent``, Pydantic AI) as a subprocess, one after another, and
reads ``/v1/stats`` before and after each. Per agent it checks:

* ``events.transparent_begin`` == the tool calls the agent made (its ``tool calls: N`` line; the
  examples force one call per tool-call turn), ``events.transparent_end`` == begins, no
  ``events.inferred_end``;
* each stall's next turn was tied to it (``next_turn.requests`` == begins) and its repeated prefix
  served from device or host: ``next_turn.prefix_tokens_recomputed`` == 0 (else the number and
  its causes, ``next_turn.recomputed_why.*``);
* no HTTP errors: every ``POST /v1/chat/completions`` of the run in the API server's access log
  answered 200, and the agent exited 0;
* no ``tokencake`` module was loaded in the agent's process.

Then the same agents on a server with ``transparent=False`` (``tokencake serve --no-transparent``):
no derived stall. Frameworks not installed are skipped with a message. Prints a table and writes the
results with provenance (versions, git commit, machine, load) to ``--out``.

    .venv/bin/python benchmarks/transparent_frameworks.py
    .venv/bin/python benchmarks/transparent_frameworks.py --only plain_openai --no-baseline --out /tmp/t.json

Exit status 1 when a check failed. It starts vLLM twice: minutes on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokencake.bench.environment import loadavg, machine, utc_now, versions
from tokencake.serving import Server

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "transparent"
DEFAULT_OUT = ROOT / "docs" / "bench" / "transparent-frameworks.json"
#: example -> (the module it needs, the pip extra that installs it)
AGENTS = {
    "plain_openai": ("openai", "openai"),
    "openai_agents": ("agents", "openai-agents"),
    "langgraph_agent": ("langchain.agents", "langchain langchain-openai langgraph"),
    "pydantic_ai_agent": ("pydantic_ai", "pydantic-ai-slim[openai]"),
}
#: The counters every row shows (their change over one agent's run).
COUNTERS = (
    "events.transparent_begin",
    "events.transparent_end",
    "events.inferred_end",
    "events.stall_begin",
    "events.stall_end",
    "requests.with_meta",
    "next_turn.requests",
    "next_turn.prefix_tokens",
    "next_turn.prefix_tokens_device",
    "next_turn.prefix_tokens_host",
    "next_turn.prefix_tokens_recomputed",
)
#: Runs the example as ``__main__`` and reports, whatever happens, which tokencake modules it loaded.
WRAPPER = """\
import runpy, sys
path = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(path, run_name="__main__")
finally:
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "tokencake")
    print("tokencake modules loaded: " + (",".join(loaded) or "-"), file=sys.stderr)
"""
_ACCESS = re.compile(r'"POST (/v1/chat/completions|/v1/responses)\S* HTTP/[\d.]+" (\d{3})')
_TOOL_CALLS = re.compile(r"^tool calls: (\d+)$", re.M)
_LOADED = re.compile(r"^tokencake modules loaded: (.*)$", re.M)


@dataclass
class AgentRun:
    """One agent program's run against one server."""

    agent: str
    status: str = "ok"  # ok | failed | skipped
    returncode: int | None = None
    seconds: float = 0.0
    tool_calls: int | None = None
    chat_requests: int | None = None
    http_errors: list[str] = field(default_factory=list)
    tokencake_modules: list[str] = field(default_factory=list)
    delta: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    output: str = ""
    stderr_tail: str = ""

    def d(self, key: str) -> float:
        return self.delta.get(key, 0.0)


def counters(server: Server) -> dict[str, float]:
    raw = server.stats().get("counters", {})
    return {k: float(v) for k, v in raw.items() if isinstance(v, int | float)}


def access_log(path: Path | None, start: int) -> list[str]:
    """The status codes of the chat requests the API server logged from byte ``start`` on."""
    if path is None or not path.exists():
        return []
    with open(path, "rb") as fh:
        fh.seek(start)
        text = fh.read().decode("utf-8", "replace")
    return [status for _route, status in _ACCESS.findall(text)]


def run_agent(name: str, server: Server, timeout: float, workdir: Path) -> AgentRun:
    """Run one example as a user would (its own process, the server's URL) and measure it."""
    run = AgentRun(name)
    module, extra = AGENTS[name]
    try:
        available = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        available = False
    if not available:
        run.status = "skipped"
        run.problems.append(f"skipped: {module} is not installed (pip install {extra})")
        return run
    before = counters(server)
    log_start = server.log_path.stat().st_size if server.log_path and server.log_path.exists() else 0
    argv = [sys.executable, "-c", WRAPPER, str(EXAMPLES / f"{name}.py")]
    argv += ["--base-url", server.base_url, "--model", server.model]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENCAKE_", "OPENAI_"))}
    started = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=workdir, env=env)
        run.returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        run.problems.append(f"did not finish in {timeout:.0f} s")
    run.seconds = round(time.monotonic() - started, 2)
    time.sleep(1.0)  # the access log line and the last acks land after the reply
    after = counters(server)
    statuses = access_log(server.log_path, log_start)
    run.delta = {
        k: after.get(k, 0.0) - before.get(k, 0.0)
        for k in sorted(set(after) | set(before) | set(COUNTERS))
        if after.get(k, 0.0) != before.get(k, 0.0) or k in COUNTERS
    }
    run.chat_requests = len(statuses) or None
    run.http_errors = [s for s in statuses if s != "200"]
    found = _TOOL_CALLS.findall(stdout)
    run.tool_calls = int(found[-1]) if found else None
    loaded = _LOADED.findall(stderr)
    run.tokencake_modules = [m for m in (loaded[-1].split(",") if loaded else []) if m and m != "-"]
    run.output = stdout[-2000:]
    run.stderr_tail = "" if run.returncode == 0 else stderr[-3000:]
    return run


def check(run: AgentRun, transparent: bool) -> None:
    """Fill ``run.problems`` (and ``status``) from the issue's acceptance."""
    if run.status == "skipped":
        return
    found = run.problems
    if run.returncode != 0:
        found.append(f"exit status {run.returncode}")
    if run.http_errors:
        found.append(f"HTTP errors: {', '.join(run.http_errors)}")
    if run.chat_requests is None:
        found.append("no chat request in the API server's access log")
    if run.tokencake_modules:
        found.append(f"the agent loaded tokencake modules: {', '.join(run.tokencake_modules)}")
    if not run.tool_calls:
        found.append("the agent made no tool call")
    begins, ends = run.d("events.transparent_begin"), run.d("events.transparent_end")
    if not transparent:
        if begins or ends:
            found.append(f"transparent mode off, yet {begins:g} begins / {ends:g} ends")
        run.status = "failed" if found else "ok"
        return
    if run.tool_calls is not None and begins != run.tool_calls:
        found.append(f"transparent begins +{begins:g}, the agent made {run.tool_calls} tool calls")
    if ends != begins:
        found.append(f"transparent ends +{ends:g} != begins +{begins:g}")
    if run.d("events.inferred_end"):
        found.append(f"inferred ends +{run.d('events.inferred_end'):g}")
    if run.d("next_turn.requests") != begins:
        found.append(f"next turns +{run.d('next_turn.requests'):g} != begins +{begins:g}")
    recomputed = run.d("next_turn.prefix_tokens_recomputed")
    if recomputed:
        why = {k: v for k, v in run.delta.items() if k.startswith("next_turn.recomputed_why.")}
        found.append(f"next-turn prefix recomputed {recomputed:g} tokens ({why or 'cause not counted'})")
    run.status = "failed" if found else "ok"


def serve_and_run(
    label: str, transparent: bool, names: list[str], log_dir: Path, timeout: float
) -> dict[str, Any]:
    """Start a server (transparent on or off), run every agent on it, stop it."""
    server = Server(port=0, transparent=transparent, log_file=log_dir / f"{label}.log", progress=True)
    load_before = loadavg()
    with server:
        print(f"\n{label}: {server.base_url} · model {server.model} · started in {server.startup_s:.0f} s")
        runs: dict[str, AgentRun] = {}
        for name in names:
            print(f"  running {name} ...", flush=True)
            runs[name] = run_agent(name, server, timeout, log_dir)
            check(runs[name], transparent)
            for problem in runs[name].problems:
                print(f"    {problem}")
    return {
        "server": {
            "model": server.model,
            "startup_s": server.startup_s,
            "settings": "Server(port=0" + ("" if transparent else ", transparent=False") + ")",
        },
        "loadavg": {"before": load_before, "after": loadavg()},
        "agents": {name: asdict(run) for name, run in runs.items()},
    }


#: The table's counter columns: (header, counter).
COLUMNS = (
    ("begin", "events.transparent_begin"),
    ("end", "events.transparent_end"),
    ("inferred", "events.inferred_end"),
    ("next turns", "next_turn.requests"),
    ("prefix tok", "next_turn.prefix_tokens"),
    ("device", "next_turn.prefix_tokens_device"),
    ("host", "next_turn.prefix_tokens_host"),
    ("recomputed", "next_turn.prefix_tokens_recomputed"),
)


def table(results: dict[str, Any]) -> str:
    """One row per agent and server mode."""
    head = ("agent", "mode", "tool calls", "chat reqs", *(h for h, _ in COLUMNS), "HTTP err", "result")
    rows = [head]
    for label, block in results["modes"].items():
        for name, run in block["agents"].items():
            counts = [f"{run['delta'].get(key, 0):g}" for _, key in COLUMNS]
            seen = [str(run[k]) if run[k] is not None else "-" for k in ("tool_calls", "chat_requests")]
            rows.append((name, label, *seen, *counts, str(len(run["http_errors"])), run["status"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT})")
    parser.add_argument("--only", choices=sorted(AGENTS), action="append", help="run only these agents")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the run on a server with transparent mode off"
    )
    parser.add_argument("--log-dir", type=Path, help="where the server logs go (default: a new temp dir)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per agent (default 600)")
    args = parser.parse_args(argv)
    names = args.only or list(AGENTS)
    started = time.monotonic()
    results: dict[str, Any] = {
        "benchmark": "transparent_frameworks",
        "created": utc_now(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "versions": versions(),
        "framework_versions": _framework_versions(),
        "machine": machine(),
        "modes": {},
    }
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="tc-transparent-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs and the agents' working directory: {log_dir}")
    modes = [("transparent", True)] + ([] if args.no_baseline else [("no_transparent", False)])
    for label, transparent in modes:
        results["modes"][label] = serve_and_run(label, transparent, names, log_dir, args.timeout)
    results["wall_s"] = round(time.monotonic() - started, 1)
    runs = [r for block in results["modes"].values() for r in block["agents"].values()]
    results["ok"] = all(r["status"] != "failed" for r in runs)
    print()
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0 if results["ok"] else 1


def _framework_versions() -> dict[str, str | None]:
    import importlib.metadata

    found: dict[str, str | None] = {}
    for dist in ("openai", "openai-agents", "langchain", "langchain-openai", "langgraph", "pydantic-ai-slim"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


if __name__ == "__main__":
    sys.exit(main())
