"""docs/notebook.ipynb and its twin docs/notebook_twin.py run on the scripted model and stay in sync."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
NOTEBOOK = DOCS / "notebook.ipynb"
TWIN = DOCS / "notebook_twin.py"


def code_cells() -> list[str]:
    nb = json.loads(NOTEBOOK.read_text())
    assert nb["nbformat"] == 4
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def offline_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENCAKE_")}
    return {**env, "MPLBACKEND": "Agg"}


def test_twin_runs_on_the_scripted_model(tmp_path: Path) -> None:
    png = tmp_path / "dag.png"
    proc = subprocess.run(
        [sys.executable, str(TWIN), str(png)],
        capture_output=True,
        text=True,
        timeout=120,
        env=offline_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "code-writer" in out and "29 nodes" in out  # the catalog listing
    assert "## References" in out and "[kv-offload]" in out  # the deep-research report cites the corpus
    assert "node" in out and "llm#" in out and "tool#" in out  # per-node timing tables
    assert "10 tool calls, each between a stall_begin and a stall_end" in out
    assert "Move the idle KV cache to host memory" in out  # the ten-line custom app
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_notebook_cells_run_with_top_level_await(monkeypatch: pytest.MonkeyPatch) -> None:
    """Execute the notebook's own cells the way Jupyter does (one namespace, top-level await)."""
    for key in [k for k in os.environ if k.startswith("TOKENCAKE_")]:
        monkeypatch.delenv(key)
    matplotlib.use("Agg")
    namespace: dict[str, object] = {}
    printed = io.StringIO()

    async def run_cells() -> None:
        for n, source in enumerate(code_cells(), 1):
            code = compile(source, f"<cell {n}>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            with contextlib.redirect_stdout(printed):
                maybe = eval(code, namespace)
                if asyncio.iscoroutine(maybe):
                    await maybe

    asyncio.run(run_cells())
    result = namespace["result"]
    assert result.status == "ok" and result.output["cited"]
    assert namespace["mini_result"].output.startswith("Move the idle KV cache")
    assert len(namespace["stalls"].pairs()) == 10
    assert namespace["fig"].axes, "the DAG picture was drawn"
    assert any("await" in c for c in code_cells()), "the guide shows top-level await"


def test_every_notebook_line_is_in_the_twin() -> None:
    twin = {line.strip() for line in TWIN.read_text().splitlines()}
    missing = [
        line.strip()
        for cell in code_cells()
        for line in cell.splitlines()
        if line.strip() and line.strip() not in twin
    ]
    assert missing == [], "notebook and twin drifted apart"
