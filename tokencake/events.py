"""The wire format shared by the SDK (client) and the serving extension (server).

This module is the *only* thing `tokencake.agents` and `tokencake.serving` have in common.
It depends on pydantic and the standard library only. See `docs/events.md` for the prose spec.

Two kinds of data cross the wire:

1. **Stall events** (``POST {events_url}/v1/events``): the SDK announces that an agent's KV is
   about to sit idle because a tool runs (``stall_begin``) and that the tool returned
   (``stall_end``). The server answers with an :class:`EventAck`.
2. **Request metadata**: every chat completion carries ``kv_transfer_params.tokencake``
   (:class:`RequestMeta`) and a vLLM ``priority`` so the server knows which agent session a
   request continues and where it sits in the app's DAG.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

WIRE_VERSION = 1
#: Key under ``kv_transfer_params`` that carries :class:`RequestMeta`.
META_KEY = "tokencake"
#: Path (relative to the events URL) that accepts one event per POST.
EVENTS_PATH = "/v1/events"
#: Path that returns the extension's counters as JSON.
STATS_PATH = "/v1/stats"
#: Liveness path of the events listener.
HEALTH_PATH = "/health"
#: By default the events listener listens on the OpenAI port + this offset.
EVENTS_PORT_OFFSET = 1

Outcome = Literal["ok", "error", "timeout", "cancelled"]


class _Wire(BaseModel):
    # Unknown fields are ignored (forward compatible); known ones are validated strictly. No
    # infinities or NaN (JSON's 1e999 parses to inf): a NaN slack would make the server's
    # admission score NaN and break the order of its waiting queue.
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


class StallBegin(_Wire):
    """A tool call starts: the agent's KV (``session_id``) is idle until the matching end."""

    type: Literal["stall_begin"] = "stall_begin"
    v: int = WIRE_VERSION
    stall_id: str = Field(min_length=1, max_length=200)
    session_id: str = Field(min_length=1, max_length=400)
    run_id: str = Field(min_length=1, max_length=200)
    node: str = Field(min_length=1, max_length=200)
    agent_type: str = Field(default="", max_length=200)
    tool: str = Field(min_length=1, max_length=200)
    kind: str = Field(default="tool", max_length=100)
    #: The client's predicted duration in seconds (tool ``predict_time``); None = no hint.
    predicted_s: float | None = Field(default=None, ge=0.0, le=86400.0)
    #: Optional internal stages {name: seconds}; their sum refines the prediction.
    stages: dict[str, float] | None = None
    attempt: int = Field(default=1, ge=1)
    #: Client wall clock (unix seconds) when the tool was about to start.
    ts: float


class StallEnd(_Wire):
    """The tool call of ``stall_id`` ended (in any way); the agent's next turn follows."""

    type: Literal["stall_end"] = "stall_end"
    v: int = WIRE_VERSION
    stall_id: str = Field(min_length=1, max_length=200)
    session_id: str = Field(min_length=1, max_length=400)
    run_id: str = Field(min_length=1, max_length=200)
    node: str = Field(min_length=1, max_length=200)
    tool: str = Field(min_length=1, max_length=200)
    outcome: Outcome = "ok"
    #: Measured tool duration in seconds (client clock).
    duration_s: float = Field(ge=0.0)
    error: str | None = Field(default=None, max_length=2000)
    ts: float


StallEvent = Annotated[StallBegin | StallEnd, Field(discriminator="type")]
_EVENT_ADAPTER: TypeAdapter[StallBegin | StallEnd] = TypeAdapter(StallEvent)


def parse_event(data: bytes | str | dict[str, Any]) -> StallBegin | StallEnd:
    """Validate one event from JSON bytes/str or a dict; raises ``pydantic.ValidationError``."""
    if isinstance(data, dict):
        return _EVENT_ADAPTER.validate_python(data)
    return _EVENT_ADAPTER.validate_json(data)


AckStatus = Literal["recorded", "duplicate", "rejected"]


class EventAck(_Wire):
    """The server's answer to one event.

    HTTP 200 with ``status`` ``recorded`` or ``duplicate``; HTTP 4xx with ``rejected`` and a
    machine-readable ``reason`` (for example ``unknown_stall``, ``end_before_begin``,
    ``invalid_event``, ``unauthorized``).
    """

    ok: bool
    status: AckStatus
    reason: str | None = None
    detail: str | None = None
    #: What the server decided for a stall_begin (gate reason code), when known at ack time.
    decision: str | None = None


class GraphMeta(_Wire):
    """A node's position in its app's DAG, computed once per app."""

    depth: int = 0
    remaining_depth: int = 0
    in_degree: int = 0
    out_degree: int = 0
    fanout_width: int = 1
    join_group: str | None = Field(default=None, max_length=200)
    on_critical_path: bool = False
    #: Seconds of slack: critical-path length minus the longest path through this node.
    slack_s: float = 0.0
    critical_path_s: float = 0.0


class NextStall(_Wire):
    """The tool the agent is expected to call after this LLM request, if declared.

    Bounded like :class:`StallBegin`: without events the server derives the stall from it.
    """

    tool: str = Field(min_length=1, max_length=200)
    kind: str = Field(default="tool", max_length=100)
    predicted_s: float | None = Field(default=None, ge=0.0, le=86400.0)


class RequestMeta(_Wire):
    """``kv_transfer_params.tokencake`` of one chat completion request.

    Its strings key the server's per-session tables, so they have the events' length limits: a
    table capped by entries must not hold megabyte keys.
    """

    v: int = WIRE_VERSION
    session_id: str = Field(min_length=1, max_length=400)
    run_id: str = Field(max_length=200)
    node: str = Field(max_length=200)
    agent_type: str = Field(default="", max_length=200)
    turn: int = 0
    importance: float = 1.0
    graph: GraphMeta = GraphMeta()
    next_stall: NextStall | None = None
    #: Whether the client reports this session's tool calls on the events API. False (no events
    #: listener reachable, e.g. replicas behind a router): the server derives each stall from the
    #: request's ``next_stall`` (begin when it finishes) and the session's next request (end).
    stall_events: bool = True


#: The HTTP header that carries the session id, for routers that keep a session on one replica
#: (``vllm-router --policy consistent_hash`` reads it first).
SESSION_HEADER = "X-Session-ID"


def priority_from_graph(graph: GraphMeta, importance: float = 1.0) -> int:
    """vLLM ``priority`` for a request (lower runs first).

    Critical-path nodes get 0; other nodes get their slack in whole seconds (capped at 100), so the
    server serves the agents that delay the whole app first. ``importance`` > 1 shrinks slack.
    """
    if graph.on_critical_path:
        return 0
    slack = graph.slack_s / max(importance, 1e-3)
    return int(min(100, max(1, round(slack))))


__all__ = [
    "EVENTS_PATH",
    "EVENTS_PORT_OFFSET",
    "HEALTH_PATH",
    "META_KEY",
    "SESSION_HEADER",
    "STATS_PATH",
    "WIRE_VERSION",
    "EventAck",
    "GraphMeta",
    "NextStall",
    "Outcome",
    "RequestMeta",
    "StallBegin",
    "StallEnd",
    "parse_event",
    "priority_from_graph",
]
