"""``Sessions``: one ``tc.Session`` per (conversation, agent), for frameworks that name both.

The server keeps one KV cache per session, so the session must follow the agent conversation, not
the framework's unit of work: a LangGraph thread's ReAct agent runs an LLM node and a tool node,
a Pydantic AI conversation spans several runs, and both must map to the same session. Frameworks
that know the conversation (a thread id, a conversation id) and the agent (its name) look the
session up here.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence

import tokencake as tc
from tokencake.events import NextStall


class Sessions:
    """Sessions keyed by ``(conversation, agent)``, created on first use, least recently used dropped.

    The session id is ``{namespace}:{conversation}:{agent}`` (hashed when longer than the wire
    allows) and its ``run_id`` is ``{namespace}:{conversation}``, so the agents of one conversation
    group together. ``namespace`` defaults to a random token, which keeps two processes that reuse
    thread ids such as ``"1"`` apart on a shared server; pin it to get the same ids after a restart.
    A ``None`` conversation (the framework named none) gets one session per agent. The other
    keywords go to every :class:`tc.Session`.
    """

    def __init__(
        self,
        *,
        namespace: str | None = None,
        importance: float = 1.0,
        next_stall: NextStall | str | None = None,
        events_url: str | bool | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        hooks: tc.StallHook | Sequence[tc.StallHook] | None = None,
        max_sessions: int = 4096,
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.namespace = namespace or uuid.uuid4().hex[:8]
        self.max_sessions = max_sessions
        self._options = {
            "importance": importance,
            "next_stall": next_stall,
            "events_url": events_url,
            "base_url": base_url,
            "api_key": api_key,
            "hooks": hooks,
        }
        self._sessions: OrderedDict[tuple[str | None, str], tc.Session] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, conversation: str | None, agent: str) -> tc.Session:
        """The session of ``agent`` in ``conversation`` (the same object for the same pair)."""
        key = (conversation, agent)
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                session = self._new(conversation, agent)
                self._sessions[key] = session
                while len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
            else:
                self._sessions.move_to_end(key)
            return session

    def _new(self, conversation: str | None, agent: str) -> tc.Session:
        conversation_key = conversation if conversation is not None else f"~{uuid.uuid4().hex[:8]}"
        run_id = _fit(f"{self.namespace}:{conversation_key}", 200)
        session_id = _fit(f"{self.namespace}:{conversation_key}:{agent}", 400)
        node = agent[:200] or "agent"
        return tc.Session(session_id, run_id=run_id, node=node, **self._options)

    def __len__(self) -> int:
        return len(self._sessions)

    def __repr__(self) -> str:
        return f"Sessions(namespace={self.namespace!r}, sessions={len(self)})"


def _fit(text: str, limit: int) -> str:
    """``text``, or a stable digest-suffixed prefix of it when longer than ``limit``."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{text[: limit - 17]}~{digest}"
