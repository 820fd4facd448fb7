"""The TokenCake fields of a chat completion request: ``kv_transfer_params.tokencake`` and ``priority``.

They are what lets the server keep one agent conversation's KV cache across its turns (the session
id) and order requests by their place in the app (the priority). ``tc.LLM`` adds them to every
request; :func:`request_metadata` builds them for any other OpenAI-compatible client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokencake.events import META_KEY, GraphMeta, NextStall, RequestMeta, priority_from_graph

#: Graph position of an agent that is not part of a TokenCake app: its own critical path.
STANDALONE_GRAPH = GraphMeta(on_critical_path=True)


def request_metadata(
    session_id: str,
    *,
    run_id: str | None = None,
    node: str | None = None,
    agent_type: str | None = None,
    turn: int = 0,
    importance: float = 1.0,
    graph: GraphMeta | None = None,
    next_stall: NextStall | str | None = None,
    priority: int | None = None,
    stall_events: bool = True,
) -> dict[str, Any]:
    """The body fields for one chat completion of conversation ``session_id``, for ``extra_body=``.

    ``session_id`` must be the same on every request of one agent conversation and on its stall
    events. ``run_id`` defaults to the session id, ``node`` to ``"agent"``, ``agent_type`` to the
    node; ``turn`` counts the conversation's requests. Without ``graph`` the agent counts as on the
    critical path (priority 0). ``next_stall`` names the tool the reply is expected to call.
    ``stall_events=False`` says this client sends no stall events: the server then derives each
    tool call from ``next_stall`` and the conversation's next request (replicas behind a router).

    >>> body = request_metadata("chat-42", turn=1, next_stall="web_search")
    >>> body["kv_transfer_params"]["tokencake"]["session_id"], body["priority"]
    ('chat-42', 0)
    """
    node = node or "agent"
    if isinstance(next_stall, str):
        next_stall = NextStall(tool=next_stall)
    meta = RequestMeta(
        session_id=session_id,
        run_id=run_id or session_id,
        node=node,
        agent_type=agent_type or node,
        turn=turn,
        importance=importance,
        graph=graph if graph is not None else STANDALONE_GRAPH,
        next_stall=next_stall,
        stall_events=stall_events,
    )
    return metadata_fields(meta, priority)


def metadata_fields(meta: RequestMeta, priority: int | None = None) -> dict[str, Any]:
    """``{"priority": ..., "kv_transfer_params": {"tokencake": meta}}`` for one request."""
    if priority is None:
        priority = priority_from_graph(meta.graph, meta.importance)
    # ``stall_events`` only when False: servers before it existed ignore it either way.
    dumped = meta.model_dump(mode="json", exclude={"stall_events"} if meta.stall_events else None)
    return {"priority": priority, "kv_transfer_params": {META_KEY: dumped}}


def merge_metadata(body: Mapping[str, Any] | None, fields: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` plus the TokenCake ``fields``; keys the caller already set are kept."""
    merged: dict[str, Any] = dict(body or {})
    kv = merged.get("kv_transfer_params")
    kv = dict(kv) if isinstance(kv, Mapping) else {}
    for key, value in (fields.get("kv_transfer_params") or {}).items():
        kv.setdefault(key, value)
    merged["kv_transfer_params"] = kv
    if "priority" in fields:
        merged.setdefault("priority", fields["priority"])
    return merged
