"""``OTelObserver``: OpenTelemetry spans for a run, following the GenAI semantic conventions.

It is an ordinary run observer: spans are built from the run events (with the events' own
timestamps), so the runner has no tracing code and ``opentelemetry`` is imported only when an
``OTelObserver`` is created (``pip install 'tokencake[otel]'``, i.e. ``opentelemetry-api``).

Span tree: ``invoke_workflow {app}`` → ``invoke_agent {node}`` (function nodes: ``run_function
{node}``; fan-out instances under their parent) → ``chat {model}`` per LLM request attempt and
``execute_tool {tool}`` per tool attempt, the latter with its ``tokencake.stall_id``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from ._result import RunEvent

_NS = 1_000_000_000


class OTelObserver:
    """A run observer that records OpenTelemetry spans: ``app.run(..., observer=tc.OTelObserver())``.

    ``tracer_provider`` defaults to the global one (``opentelemetry.trace``); ``tracer`` overrides
    both. One observer can watch many runs at once (spans are keyed by run id). The run span's
    parent is the span that was current when the run started.
    """

    def __init__(self, *, tracer_provider: Any = None, tracer: Any = None) -> None:
        try:
            from opentelemetry import trace
        except ImportError as exc:  # pragma: no cover - exercised where the extra is missing
            raise ImportError(
                "tc.OTelObserver needs opentelemetry-api: pip install 'tokencake[otel]'"
            ) from exc
        from tokencake._version import __version__

        self._trace = trace
        self._tracer = tracer or trace.get_tracer("tokencake", __version__, tracer_provider=tracer_provider)
        self._spans: dict[tuple[str, ...], Any] = {}

    def __call__(self, event: RunEvent) -> None:
        handler = getattr(self, f"_on_{event.kind}", None)
        if handler is not None:
            handler(event, event.run_id)

    # ------------------------------------------------------------------ spans

    def _start(
        self, key: tuple[str, ...], name: str, parent: Any, ts: float, kind: str, **attrs: Any
    ) -> None:
        context = self._trace.set_span_in_context(parent) if parent is not None else None
        span = self._tracer.start_span(
            name,
            context=context,
            kind=getattr(self._trace.SpanKind, kind),
            attributes={k.replace("__", "."): v for k, v in attrs.items() if v is not None},
            start_time=int(ts * _NS),
        )
        self._spans[key] = span

    def _end(self, key: tuple[str, ...], ts: float, error: str | None = None, **attrs: Any) -> None:
        span = self._spans.pop(key, None)
        if span is None:
            return
        for name, value in attrs.items():
            if value is not None:
                span.set_attribute(name.replace("__", "."), value)
        if error is not None:
            span.set_attribute("error.type", error.split(":", 1)[0][:100] or "error")
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error[:500]))
        span.end(end_time=int(ts * _NS))

    # ------------------------------------------------------------------ events

    def _on_run_started(self, ev: RunEvent, run: str) -> None:
        app = str(ev.data.get("app", ""))
        self._start(
            (run,),
            f"invoke_workflow {app}",
            None,
            ev.ts,
            "INTERNAL",
            gen_ai__operation__name="invoke_workflow",
            gen_ai__workflow__name=app,
            tokencake__run_id=run,
        )

    def _on_run_finished(self, ev: RunEvent, run: str) -> None:
        status = str(ev.data.get("status", ""))
        for key in [k for k in self._spans if k[0] == run and len(k) > 1]:
            self._end(key, ev.ts, error=f"{status}: the run ended first")
        self._end(
            (run,),
            ev.ts,
            error=None if status == "ok" else f"{status}: run {status}",
            tokencake__status=status,
        )

    def _on_node_started(self, ev: RunEvent, run: str) -> None:
        node = str(ev.node)
        parent_node = ev.data.get("parent")
        parent = self._spans.get((run, "node", parent_node) if parent_node else (run,))
        agent = ev.data.get("kind") != "function"
        self._start(
            (run, "node", node),
            f"invoke_agent {node}" if agent else f"run_function {node}",
            parent,
            ev.ts,
            "INTERNAL",
            gen_ai__operation__name="invoke_agent" if agent else None,
            gen_ai__agent__name=node if agent else None,
            tokencake__node=node,
            tokencake__node__kind=ev.data.get("kind"),
            tokencake__template=ev.data.get("template"),
            tokencake__queue_s=ev.data.get("queue_s"),
        )

    def _on_node_finished(self, ev: RunEvent, run: str) -> None:
        self._end((run, "node", str(ev.node)), ev.ts)

    def _on_node_failed(self, ev: RunEvent, run: str) -> None:
        self._end((run, "node", str(ev.node)), ev.ts, error=str(ev.data.get("error") or "failed"))

    def _llm_key(self, ev: RunEvent, run: str) -> tuple[str, ...]:
        d = ev.data
        return (run, "llm", str(ev.node), str(d.get("session_id")), str(d.get("turn")), str(d.get("attempt")))

    def _on_llm_started(self, ev: RunEvent, run: str) -> None:
        d = ev.data
        model = d.get("model") or ""
        server = urlsplit(str(d.get("server") or ""))
        self._start(
            self._llm_key(ev, run),
            f"chat {model}".strip(),
            self._spans.get((run, "node", str(ev.node))),
            ev.ts,
            "CLIENT",
            gen_ai__operation__name="chat",
            gen_ai__request__model=model or None,
            gen_ai__request__max_tokens=d.get("max_tokens"),
            gen_ai__request__temperature=d.get("temperature"),
            gen_ai__request__stream=d.get("stream"),
            gen_ai__conversation__id=d.get("session_id"),
            server__address=server.hostname,
            server__port=server.port,
            tokencake__turn=d.get("turn"),
            tokencake__attempt=d.get("attempt"),
        )

    def _on_llm_finished(self, ev: RunEvent, run: str) -> None:
        d = ev.data
        self._end(
            self._llm_key(ev, run),
            ev.ts,
            gen_ai__response__model=d.get("model") or None,
            gen_ai__response__finish_reasons=[d["finish_reason"]] if d.get("finish_reason") else None,
            gen_ai__usage__input_tokens=d.get("prompt_tokens"),
            gen_ai__usage__output_tokens=d.get("completion_tokens"),
            tokencake__tool_calls=list(d.get("tool_calls") or []) or None,
        )

    def _on_llm_failed(self, ev: RunEvent, run: str) -> None:
        d = ev.data
        self._end(
            self._llm_key(ev, run),
            ev.ts,
            error=str(d.get("error") or "failed"),
            tokencake__retry_in_s=d.get("retry_in_s"),
        )

    def _on_tool_started(self, ev: RunEvent, run: str) -> None:
        d = ev.data
        tool = str(d.get("tool"))
        self._start(
            (run, "tool", str(d.get("stall_id"))),
            f"execute_tool {tool}",
            self._spans.get((run, "node", str(ev.node))),
            ev.ts,
            "INTERNAL",
            gen_ai__operation__name="execute_tool",
            gen_ai__tool__name=tool,
            gen_ai__tool__type="function",
            gen_ai__tool__call__id=d.get("call_id") or None,
            gen_ai__conversation__id=d.get("session_id"),
            tokencake__stall_id=d.get("stall_id"),
            tokencake__tool__kind=d.get("kind"),
            tokencake__tool__predicted_s=d.get("predicted_s"),
            tokencake__attempt=d.get("attempt"),
        )

    def _on_tool_finished(self, ev: RunEvent, run: str) -> None:
        d = ev.data
        outcome = str(d.get("outcome"))
        self._end(
            (run, "tool", str(d.get("stall_id"))),
            ev.ts,
            error=None if outcome == "ok" else f"{outcome}: {d.get('error') or outcome}",
            tokencake__tool__outcome=outcome,
            tokencake__tool__duration_s=d.get("duration_s"),
            tokencake__retry_in_s=d.get("retry_in_s"),
        )
