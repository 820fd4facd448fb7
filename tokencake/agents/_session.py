"""``Session`` and ``stall``: TokenCake for agents that do not run as a ``tc.App``.

The server-side benefit needs two things from any agent, whatever framework drives it: every chat
completion of one conversation carries the same session id (so the server can find its KV cache),
and every tool call is bracketed by ``stall_begin`` / ``stall_end`` naming that session (so the
server can move the idle KV out and back). A ``Session`` holds that identity; ``stall`` brackets a
tool call; ``TokenCakeTransport`` (``_transport``) stamps the requests.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from urllib.parse import urlsplit

from tokencake.events import GraphMeta, NextStall, StallBegin

from ._events_probe import is_derived_local, missing_listener_sync
from ._llm import DEFAULT_BASE_URL, events_url_for
from ._metadata import STANDALONE_GRAPH, request_metadata
from ._stall import HttpStallReporter, StallHook, StallHooks, StallScope

_REPORTERS: dict[tuple[str, str | None], HttpStallReporter] = {}
_REPORTERS_LOCK = threading.Lock()


def _shared_reporter(events_url: str, api_key: str | None) -> HttpStallReporter:
    # One reporter (and connection pool, and "no extension" warning) per events URL, however many
    # sessions a process opens.
    with _REPORTERS_LOCK:
        key = (events_url, api_key)
        if key not in _REPORTERS:
            _REPORTERS[key] = HttpStallReporter(events_url, api_key=api_key)
        return _REPORTERS[key]


class Session:
    """One agent conversation as a TokenCake server sees it.

    ``session_id`` (default: a fresh random id) must stay the same for the whole conversation.
    ``run_id`` groups sessions (default: the session id), ``node`` / ``agent_type`` name the agent,
    ``importance`` and ``graph`` set its priority (default: critical, priority 0) and ``next_stall``
    the tool its replies are expected to call. Stall events go to ``events_url`` (default: as for
    :class:`LLM`: ``TOKENCAKE_EVENTS_URL``, else port + 1 of a loopback ``base_url`` /
    ``TOKENCAKE_BASE_URL``; ``False`` disables them) and to any extra ``hooks``.
    """

    def __init__(
        self,
        session_id: str | None = None,
        *,
        run_id: str | None = None,
        node: str = "agent",
        agent_type: str | None = None,
        importance: float = 1.0,
        graph: GraphMeta | None = None,
        next_stall: NextStall | str | None = None,
        events_url: str | bool | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        hooks: StallHook | Sequence[StallHook] | None = None,
    ) -> None:
        self.session_id = session_id or f"session-{uuid.uuid4().hex[:12]}"
        if not isinstance(self.session_id, str) or not 0 < len(self.session_id) <= 400:
            raise ValueError("session_id must be a string of 1..400 characters")
        self.run_id = run_id or self.session_id[:200]
        self.node = node
        self.agent_type = agent_type or node
        self.importance = importance
        self.graph = graph if graph is not None else STANDALONE_GRAPH
        self.next_stall = NextStall(tool=next_stall) if isinstance(next_stall, str) else next_stall
        #: Requests sent so far in this conversation (the ``turn`` of the next one).
        self.turn = 0
        base = base_url or os.environ.get("TOKENCAKE_BASE_URL") or DEFAULT_BASE_URL
        #: The OpenAI base URL of this conversation's server (``openai_client`` defaults to it).
        self.base_url = base.rstrip("/")
        api_key = api_key or os.environ.get("TOKENCAKE_API_KEY") or None
        self.api_key = api_key
        extra = [] if hooks is None else [hooks] if not isinstance(hooks, Sequence) else list(hooks)
        for hook in extra:
            if not (callable(getattr(hook, "begin", None)) and callable(getattr(hook, "end", None))):
                raise TypeError(f"stall hook {hook!r} needs async begin(ev) and end(ev) methods")
        self._extra_hooks = extra
        self._set_events_url(events_url_for(self.base_url, events_url))
        # Whether the server was named (argument or environment): use_server() keeps a named one.
        self._base_given = bool(base_url or os.environ.get("TOKENCAKE_BASE_URL"))
        self._events_given = events_url is not None or bool(os.environ.get("TOKENCAKE_EVENTS_URL"))
        self._warned_server = False
        self._stalls = itertools.count(1)
        self._token = uuid.uuid4().hex[:8]
        self._lock = threading.Lock()

    def _set_events_url(self, events_url: str | None) -> None:
        self.events_url = events_url
        self.reporter = _shared_reporter(events_url, self.api_key) if events_url else None
        self.hooks = StallHooks([*self._extra_hooks, *([self.reporter] if self.reporter else [])])

    def use_server(self, base_url: str) -> None:
        """This conversation's chat completions go to ``base_url``: make it the session's server.

        Adapters call it with their model client's URL, so the server is named in one place. A
        session built without one (no ``base_url`` / ``events_url`` argument, no
        ``TOKENCAKE_BASE_URL`` / ``TOKENCAKE_EVENTS_URL``) takes ``base_url``, and its stall events
        follow it by the usual rules (port + 1 of a loopback URL). A session whose server was named
        keeps it; when its stall events then go elsewhere than ``base_url``'s events listener (another
        host, or for a derived events URL another port), a ``RuntimeWarning`` says so, once.
        """
        base = base_url.rstrip("/")
        with self._lock:
            if base == self.base_url:
                return
            if not self._base_given:
                self.base_url = base
                if not self._events_given:
                    self._set_events_url(events_url_for(base, None))
                    return
            if self.events_url is None or self._warned_server:
                return
            if self._events_given:
                disagree = urlsplit(self.events_url).hostname != urlsplit(base).hostname
            else:
                disagree = self.events_url != events_url_for(base, True)
            self._warned_server = disagree
        if disagree:
            warnings.warn(
                f"session {self.session_id!r}: chat completions go to {base} but stall events to "
                f"{self.events_url}; name the server once (tc.Session(base_url=...) or the adapter's "
                "base_url=), or set events_url= to that server's events listener",
                RuntimeWarning,
                stacklevel=3,
            )

    def request_metadata(self, *, advance: bool = True) -> dict[str, object]:
        """The body fields for this conversation's next request (``extra_body=``); counts the turn."""
        with self._lock:
            turn = self.turn
            if advance:
                self.turn += 1
        return request_metadata(
            self.session_id,
            run_id=self.run_id,
            node=self.node,
            agent_type=self.agent_type,
            turn=turn,
            importance=self.importance,
            graph=self.graph,
            next_stall=self.next_stall,
            stall_events=self._sends_events(),
        )

    def _sends_events(self) -> bool:
        """Whether this conversation's stall events reach a listener. The loopback port + 1 it
        derived is checked first (``_events_probe``; a blocking GET of at most a second, once a
        minute): with no events listener there (a router) the session sends none, and its
        requests say ``stall_events: false``."""
        url = self.events_url
        if url is None:
            return False
        if is_derived_local(url, events_url_for(self.base_url, True)) and missing_listener_sync(url):
            self.events_url = None
            self.hooks = StallHooks([h for h in self.hooks.hooks if h is not self.reporter])
            self.reporter = None
            return False
        return True

    def stall(
        self,
        tool: str,
        *,
        kind: str = "tool",
        predicted_s: float | None = None,
        stages: dict[str, float] | None = None,
        attempt: int = 1,
    ) -> StallScope:
        """``async with session.stall("web_search", predicted_s=2.0): ...`` (see :func:`stall`)."""
        self._sends_events()
        begin = StallBegin(
            stall_id=f"{self.run_id[:150]}:{self._token}:{next(self._stalls)}",
            session_id=self.session_id,
            run_id=self.run_id,
            node=self.node,
            agent_type=self.agent_type,
            tool=tool,
            kind=kind,
            predicted_s=predicted_s,
            stages=stages,
            attempt=attempt,
            ts=time.time(),
        )
        return StallScope(begin, self.hooks.begin, self.hooks.end)

    def __repr__(self) -> str:
        return f"Session({self.session_id!r}, events_url={self.events_url!r})"


def stall(
    session: Session,
    tool: str,
    *,
    kind: str = "tool",
    predicted_s: float | None = None,
    stages: dict[str, float] | None = None,
    attempt: int = 1,
) -> StallScope:
    """Bracket one tool call of ``session`` with ``stall_begin`` / ``stall_end``.

    ``async with tc.stall(session, "web_search", kind="search", predicted_s=2.0): ...`` sends the
    begin event, runs the block, and sends the end event whatever happens: also when the block
    raises or is cancelled (the end is sent in a shielded scope). ``predicted_s`` (or ``stages``)
    is what lets the server decide whether moving the KV out pays. Delivery failures never reach
    the block; its exceptions propagate unchanged.
    """
    if not isinstance(session, Session):
        raise TypeError(f"stall() needs a tc.Session, got {type(session).__name__} (tc.Session({session!r}))")
    return session.stall(tool, kind=kind, predicted_s=predicted_s, stages=stages, attempt=attempt)
