"""What ``tokencake run`` prints about a finished run: the ``--json`` document and the summary table."""

from __future__ import annotations

from typing import Any

#: Version of the ``run --json`` document (bump when a field changes meaning).
RUN_JSON_VERSION = 1


def _node_rows(result: Any) -> dict[str, dict[str, Any]]:
    rows = {}
    for name, node in result.nodes.items():
        rows[name] = {
            "status": node.status,
            "queue_s": round(node.queue_s, 6),
            "wall_s": round(node.wall_s, 6),
            "llm_s": round(node.llm_s, 6),
            "tool_s": round(node.tool_s, 6),
            "stall_s": round(node.stall_s, 6),
            "llm_calls": node.llm_calls,
            "tool_calls": node.tool_calls,
            "tokens": {
                "prompt": node.usage.prompt_tokens,
                "completion": node.usage.completion_tokens,
                "total": node.usage.total_tokens,
            },
            "error": node.error,
        }
    return rows


def run_document(
    name: str,
    app: Any,
    result: Any,
    *,
    inputs: dict[str, str],
    model: str | None,
    latency: str,
    error: str | None = None,
) -> dict[str, Any]:
    """The ``run --json`` document (see docs/apps.md for the fields)."""
    from tokencake.agents import catalog

    begins = [e for e in result.stall_events if e.type == "stall_begin"]
    ends = {e.stall_id for e in result.stall_events if e.type == "stall_end"}
    full = result.to_dict()  # JSON-able outputs (non-JSON values become their repr)
    output = full["output"] if result.status == "ok" else None
    return {
        "version": RUN_JSON_VERSION,
        "app": name,
        "run_id": result.run_id,
        "status": result.status,
        "error": error,
        "model": model,
        "latency": latency,
        "inputs": inputs,
        "wall_s": round(result.wall_s, 6),
        "critical_path": app.critical_path,
        "usage": {
            "prompt": result.usage.prompt_tokens,
            "completion": result.usage.completion_tokens,
            "total": result.usage.total_tokens,
        },
        "tool_calls": sum(n.tool_calls for n in result.nodes.values()),
        "llm_calls": sum(n.llm_calls for n in result.nodes.values()),
        "stall_events": len(result.stall_events),
        "stall_pairs": sum(1 for b in begins if b.stall_id in ends),
        "nodes": _node_rows(result),
        "outputs": {k: full["nodes"][k]["output"] for k in result.outputs},
        "output": output,
        "answer": catalog.final_answer(name, result.output) if result.status == "ok" else None,
    }


#: The run summary's columns: (title, column of ``RunResult.TIMING_COLUMNS``).
_SUMMARY_COLUMNS = (
    ("node", "node"),
    ("status", "status"),
    ("LLM s", "llm"),
    ("tool s", "tool"),
    ("stall s", "stall"),
    ("tokens", "tokens"),
    ("LLM#", "llm#"),
    ("tool#", "tool#"),
)


def summary_table(result: Any) -> Any:
    from rich.table import Table

    table = Table(title=f"{result.app}  run {result.run_id}  ({result.wall_s:.2f}s)", title_justify="left")
    index = [result.TIMING_COLUMNS.index(key) for _, key in _SUMMARY_COLUMNS]
    for title, key in _SUMMARY_COLUMNS:
        table.add_column(title, justify="left" if key in ("node", "status") else "right")
    rows, total = result.timing_rows()
    for row in rows:
        table.add_row(*(row[i] for i in index))
    table.add_section()
    table.add_row(*(total[i] for i in index))
    return table


__all__ = ["RUN_JSON_VERSION", "run_document", "summary_table"]
