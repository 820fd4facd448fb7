"""The tested twin of ``docs/notebook.ipynb``: the same cells, as a script.

Jupyter cells use top-level ``await``; here they live in ``async def main()`` run by ``anyio.run``.
``tests/docs/test_notebook_twin.py`` runs this file on the scripted model and checks that every
code line of the notebook still appears here, so the two cannot drift apart.

Usage: ``python docs/notebook_twin.py [DAG_PNG_PATH]`` (set ``TOKENCAKE_BASE_URL`` for a real model).
"""

from __future__ import annotations

import itertools
import os
import sys

import anyio
import matplotlib

matplotlib.use("Agg")  # a script has no display; Jupyter shows the figure inline instead

import matplotlib.pyplot as plt
import networkx as nx

import tokencake as tc
from tokencake.agents import catalog

BASE_URL = os.environ.get("TOKENCAKE_BASE_URL")


def make_llm(app_name, script=None):
    """A real server when TOKENCAKE_BASE_URL is set, otherwise the offline scripted model."""
    if BASE_URL:
        return tc.LLM(BASE_URL, events_url="auto")
    return tc.ScriptedLLM(script) if script is not None else catalog.scripted_llm(app_name)


def draw(app):
    graph, path = app.graph, app.critical_path
    on_path = set(itertools.pairwise(path))
    layers = {}  # depth -> nodes, sorted so that parallel branches line up
    for node, depth in sorted(graph.nodes(data="depth")):
        layers.setdefault(depth, []).append(node)
    pos = nx.multipartite_layout(graph, subset_key=layers)
    fig, ax = plt.subplots(figsize=(11, 4))
    nx.draw_networkx(
        graph,
        pos,
        ax=ax,
        node_size=220,
        font_size=7,
        node_color=["tab:red" if n in path else "tab:blue" for n in graph],
        edge_color=["tab:red" if e in on_path else "0.75" for e in graph.edges],
    )
    ax.set_title(f"{app.name}: critical path {app.critical_path_s:.1f}s predicted")
    ax.set_axis_off()
    return fig


mini = tc.App("mini-research", inputs=["task"])
NOTES = {"offload": "Park idle KV blocks in host memory.", "prefetch": "Copy them back in time."}


@mini.tool(predict_time=2.0, kind="search")
def lookup(topic: str) -> str:
    """Look up a note ('offload' or 'prefetch')."""
    return NOTES.get(topic.strip().lower(), "no such note")


@mini.agent(max_tokens=64, calls=["lookup"])
async def researcher(ctx, inputs):
    topic = await ctx.llm(f"Which note helps with: {ctx.inputs['task']}? Answer offload or prefetch.")
    note = await ctx.call("lookup", topic=topic.text)
    return (await ctx.llm(f"The note says: {note} Answer in one sentence.")).text


async def main(png_path: str | None = None) -> None:
    for info in catalog.list_apps():
        print(f"{info.name:<14} {info.nodes:>3} nodes  {info.description}")

    app = catalog.get_app("deep-research", latency="scaled:0", branches=3)
    stalls = tc.StallRecorder()
    task = "How can an LLM server keep agents' KV cache useful while they wait for tools?"
    result = await app.run(llm=make_llm("deep-research"), stall=stalls, task=task)
    print(result.output["report"])

    print(result.timings_table())

    pairs = stalls.pairs()
    print(f"{len(pairs)} tool calls, each between a stall_begin and a stall_end:")
    for begin, end in pairs[:4]:
        took = end.duration_s
        print(f"  {begin.node:<13} {begin.tool:<15} predicted {begin.predicted_s:3.1f}s, took {took:.3f}s")

    fig = draw(app)
    if png_path:
        fig.savefig(png_path, dpi=80)
        print(f"DAG picture: {png_path}")
    plt.close(fig)

    script = {"researcher": ["offload", "Move the idle KV cache to host memory while the tool runs."]}
    mini_result = await mini.run(
        llm=make_llm("mini-research", script), task="What to do with KV cache during a tool call?"
    )
    print(mini_result.output)
    print(mini_result.timings_table())


if __name__ == "__main__":
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else None)
