"""Transparent mode's conversation state: which plain OpenAI request continues which conversation.

A client that does not import TokenCake sends no session id. The server still produced the tool
call that ended a turn, and the conversation's next request repeats the whole message list with
that call in it, so the list itself names the conversation:

* every message (Chat Completions) or input item (Responses API) has a canonical form, so that a
  client's re-serialisation does not change it: content ``None`` == ``""``, content parts →
  their text, tool-call arguments parsed as JSON and dumped with sorted keys, transport fields
  (item ``id`` / ``status``, ``type: function``, reasoning) left out;
* a chained digest runs over the canonical entries, message by message (:func:`chain`);
* after a turn that ended in tool calls (and after every later reply of that conversation), the
  chained digest of request + reply is stored for the conversation at each tool-call position of
  the reply and at its end (:func:`reply_keys`, :meth:`ConversationTable.record`): a client may
  append all of a reply's calls before their outputs or interleave them (Responses API). A new
  request matches when its chain passes a stored digest at a reply position (an assistant message
  or a model's item, :func:`lookup_points`) — the latest such position first.

A stored key continues its conversation once (:meth:`Conversation.continues`): a second request
from the same point — sub-agents forked from one history, a regenerated answer — starts a child
conversation (:meth:`Conversation.fork`: a session of its own). A request ends only the tool calls
it answers (:func:`answered_calls`); a call that nobody answers is left to the core's stall expiry.

Two conversations that share a system prompt and first message diverge at their first tool
call: its ids differ, so do their digests. A digest that two live conversations produce anyway
(a model that numbers its call ids, answering two identical requests) belongs to neither: a
continuation then starts a new conversation instead of merging two.

The table is bounded (least recently used conversations go first) and holds digests, ids and
tool names only, never message text. A conversation that is dropped or never continued leaves
its open stall to the core's stall expiry. Single-threaded (one asyncio loop per API server).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "KEYS_PER_CONVERSATION",
    "OPEN_CALLS_PER_CONVERSATION",
    "SESSION_HEADER",
    "TRANSPARENT_NODE",
    "Conversation",
    "ConversationTable",
    "Entry",
    "OpenCall",
    "answered_calls",
    "chain",
    "chat_entries",
    "chat_message_entry",
    "lookup_points",
    "new_session_id",
    "predict_next_tool",
    "reply_keys",
    "response_key",
    "responses_entries",
    "responses_item_entry",
    "stall_id_for",
]

#: ``node`` and ``agent_type`` of every stall and request that transparent mode derives: the core
#: counts its recorded events as ``events.transparent_begin`` / ``events.transparent_end`` and
#: learns tool durations per tool name under this agent type.
TRANSPARENT_NODE = "transparent"
#: Request header that names a conversation explicitly (the no-import way to pin identity).
SESSION_HEADER = "X-TokenCake-Session"
#: How many lookup keys (digests, response ids) a conversation keeps: those of its recent replies.
KEYS_PER_CONVERSATION = 16
#: Tool calls a conversation keeps open (the oldest unanswered ones are dropped: left to expiry).
OPEN_CALLS_PER_CONVERSATION = 64
_SEED = b"tokencake-transparent-v1\x00"


class Entry(NamedTuple):
    """One message or input item in canonical form; ``call`` marks a tool-call position,
    ``reply`` an entry the model wrote (where a reply may end: a lookup position)."""

    data: bytes
    call: bool
    reply: bool = False


class OpenCall(NamedTuple):
    """A tool call whose stall began (monotonic ``begun_at``) and no request answered yet.

    ``delivery`` is the ASGI layer's delivery of its ``stall_begin`` (an awaitable giving the
    stall ids it recorded), which the request that answers the call waits for before ending it.
    """

    call_id: str
    stall_id: str
    tool: str
    begun_at: float
    delivery: Any = None


@dataclass(eq=False)
class Conversation:
    """One conversation: its session id, turn count, open tool calls and lookup keys.

    ``pending`` is the ASGI layer's latest begin delivery: a later turn's begins go out after it.
    """

    session_id: str
    #: Requests of the conversation seen so far (the ``turn`` of the next one).
    turns: int = 0
    calls: list[OpenCall] = field(default_factory=list)
    #: The tool its last tool turn called last (the predicted next call); None: it has called
    #: none yet (not an agent loop so far).
    last_tool: str | None = None
    #: Its lookup keys, each with the turn whose reply stored it (oldest first).
    keys: deque[tuple[bytes | str, int]] = field(default_factory=lambda: deque(maxlen=KEYS_PER_CONVERSATION))
    pending: Any = None

    @property
    def run_id(self) -> str:
        return self.session_id[:200]

    def continues(self, key_turn: int) -> bool:
        """Whether a request found by a key of turn ``key_turn``'s reply continues this
        conversation: no later turn has started (none continued from that key before, none from
        a later one, none in flight). Else it is a fork (:meth:`fork`)."""
        return self.turns == key_turn + 1

    def fork(self, key_turn: int) -> Conversation:
        """A child conversation that continues from turn ``key_turn``'s reply: a session of its
        own (its turns numbered on from there), the tool this one called last, no keys yet."""
        return Conversation(new_session_id(), turns=key_turn + 1, last_tool=self.last_tool)

    def add_calls(self, calls: Iterable[OpenCall]) -> None:
        """Open ``calls`` (at most :data:`OPEN_CALLS_PER_CONVERSATION` stay open, newest kept)."""
        self.calls = [*self.calls, *calls][-OPEN_CALLS_PER_CONVERSATION:]

    def take_calls(self, answered: Collection[str]) -> list[OpenCall]:
        """The open calls whose call id is in ``answered`` (a request's tool results); they are
        no longer open, the others stay open."""
        taken = [c for c in self.calls if c.call_id in answered]
        if taken:
            self.calls = [c for c in self.calls if c.call_id not in answered]
        return taken


def new_session_id() -> str:
    """A fresh session id for a conversation nobody named."""
    return f"{TRANSPARENT_NODE}-{uuid.uuid4().hex[:16]}"


def stall_id_for(call_id: str, session_id: str, turn: int) -> str:
    """The stall id of one tool call: the call id, made unique per session and turn (some models
    number their call ids, ``functions.search:0``, which would repeat across turns and sessions)."""
    tag = hashlib.sha256(session_id.encode()).hexdigest()[:12]
    return f"{call_id[:150] or 'call'}@{tag}.{turn}"


def response_key(response_id: str) -> str:
    """The lookup key of a Responses API response id (``previous_response_id``)."""
    return f"r:{response_id}"


# -- canonical forms ------------------------------------------------------------------------------


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _text(content: Any) -> str:
    """Content as text: None == "", text parts joined, other parts as canonical JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(_dump(part))
        return "".join(parts)
    return _dump(content)


def _arguments(arguments: Any) -> str:
    """Tool-call arguments as JSON with sorted keys (unparseable text stays as sent)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return _dump(arguments)


def _encode(value: list[Any]) -> bytes:
    return _dump(value).encode()


def _chat_calls(tool_calls: Any) -> list[list[str]]:
    calls = []
    for call in tool_calls if isinstance(tool_calls, list) else []:
        if not isinstance(call, Mapping):
            calls.append(["?", _dump(call)])
            continue
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else {}
        calls.append([str(call.get("id") or ""), str(fn.get("name") or ""), _arguments(fn.get("arguments"))])
    return calls


def chat_message_entry(message: Any) -> Entry:
    """The canonical entry of one chat message (request message or the reply's message).

    An assistant message is the server's reply as the client sends it back: only its content and
    tool calls count (fields clients add or drop, such as ``name``, do not)."""
    if not isinstance(message, Mapping):
        return Entry(_encode(["?", _dump(message)]), False)
    role = str(message.get("role") or "")
    if role == "assistant":
        calls = _chat_calls(message.get("tool_calls"))
        return Entry(_encode([role, _text(message.get("content")), calls]), bool(calls), True)
    name = message.get("name") if isinstance(message.get("name"), str) else ""
    call_id = message.get("tool_call_id") if isinstance(message.get("tool_call_id"), str) else ""
    return Entry(_encode([role, _text(message.get("content")), name, call_id, []]), False)


def chat_entries(messages: Sequence[Any]) -> list[Entry]:
    """The canonical entries of a Chat Completions message list."""
    return [chat_message_entry(m) for m in messages]


#: Fields of a Responses API item that a client may drop or the server adds (not content).
_TRANSPORT_FIELDS = frozenset({"id", "status", "annotations", "logprobs"})


def responses_item_entry(item: Any) -> Entry | None:
    """The canonical entry of one Responses API input or output item (None: left out)."""
    if isinstance(item, str):
        return Entry(_encode(["user", item]), False)
    if not isinstance(item, Mapping):
        return Entry(_encode(["?", _dump(item)]), False)
    kind = item.get("type")
    if kind == "reasoning":  # clients may or may not send reasoning back
        return None
    if kind == "function_call":
        data = ["call", str(item.get("call_id") or ""), str(item.get("name") or ""),
                _arguments(item.get("arguments"))]  # fmt: skip
        return Entry(_encode(data), True, True)
    if kind == "function_call_output":
        return Entry(_encode(["output", str(item.get("call_id") or ""), _text(item.get("output"))]), False)
    if kind in (None, "message"):
        role = str(item.get("role") or "")
        return Entry(_encode([role, _text(item.get("content"))]), False, role == "assistant")
    rest = {k: v for k, v in item.items() if k not in _TRANSPORT_FIELDS}
    # Another kind of item: the model's (a reply may end there) unless it is an input's output.
    return Entry(_encode(["item", _dump(rest)]), False, not str(kind).endswith("_output"))


def responses_entries(body: Mapping[str, Any]) -> list[Entry]:
    """The canonical entries of a Responses API request: ``instructions``, then ``input``."""
    entries: list[Entry] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        entries.append(Entry(_encode(["system", instructions]), False))
    raw = body.get("input")
    items: Iterable[Any] = [raw] if isinstance(raw, str) else raw if isinstance(raw, list) else []
    for item in items:
        entry = responses_item_entry(item)
        if entry is not None:
            entries.append(entry)
    return entries


def chain(entries: Iterable[Entry], start: bytes | None = None) -> list[bytes]:
    """The chained digest after each entry (``start``: the chain so far, default the empty one)."""
    digest = start if start is not None else hashlib.sha256(_SEED).digest()
    out = []
    for entry in entries:
        digest = hashlib.sha256(digest + entry.data).digest()
        out.append(digest)
    return out


def lookup_points(entries: Sequence[Entry], digests: Sequence[bytes]) -> list[bytes]:
    """A request's lookup keys: the digests at the positions where a reply may have ended (the
    model's entries), latest first (the lookup order)."""
    return [digests[i] for i in range(len(entries) - 1, -1, -1) if entries[i].reply]


def reply_keys(entries: Sequence[Entry], start: bytes | None) -> list[bytes]:
    """The keys a reply stores (``entries``: its canonical entries; ``start``: the chain of its
    request): the digest at each tool-call position and at its end. A client that appends all
    calls before their outputs passes the end; one that puts each output after its call (the
    Responses API's loop) passes the first call. At most ``KEYS_PER_CONVERSATION // 2`` (the
    first ones and the end), so the conversation's previous turn stays findable too."""
    if not entries:
        return []
    digests = chain(entries, start)
    points = [i for i, entry in enumerate(entries[:-1]) if entry.call]
    cap = KEYS_PER_CONVERSATION // 2
    return [digests[i] for i in points[: cap - 1]] + [digests[-1]]


def answered_calls(api: str, body: Mapping[str, Any]) -> set[str]:
    """The tool call ids a request brings results for: its ``tool`` messages' ``tool_call_id``
    (Chat Completions) or its ``function_call_output`` items' ``call_id`` (Responses API)."""
    if api == "chat":
        items, kind, field_name = body.get("messages"), None, "tool_call_id"
    else:
        items, kind, field_name = body.get("input"), "function_call_output", "call_id"
    out = set()
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, Mapping):
            continue
        if (item.get("role") == "tool") if kind is None else (item.get("type") == kind):
            value = item.get(field_name)
            if isinstance(value, str) and value:
                out.add(value)
    return out


# -- the next tool --------------------------------------------------------------------------------


def _tool_names(tools: list[Any]) -> list[str]:
    names = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else tool.get("name")  # chat, responses
        if isinstance(name, str) and name:
            names.append(name)
    return names


def predict_next_tool(body: Mapping[str, Any], last_tool: str | None) -> str | None:
    """The tool the reply is expected to call, or None (the same rule as the SDK's agents): a
    forced named tool; the only tool offered; else the one the conversation called last, if still
    offered. ``tool_choice: "none"`` announces nothing (the call could not come)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not isinstance(tools, list) or not tools or choice == "none":
        return None
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, Mapping) else choice.get("name")
        if isinstance(named, str) and named:
            return named[:200]
    names = _tool_names(tools)
    if len(names) == 1:
        return names[0][:200]
    if last_tool is not None and last_tool in names:
        return last_tool
    return None


# -- the table ------------------------------------------------------------------------------------


class ConversationTable:
    """Conversations by session id and by lookup key, least recently used evicted first. Each
    key also names the turn whose reply stored it (:meth:`Conversation.continues`)."""

    def __init__(self, max_conversations: int = 4096) -> None:
        if max_conversations < 1:
            raise ValueError(f"max_conversations must be >= 1, got {max_conversations}")
        self.max_conversations = max_conversations
        self._by_session: OrderedDict[str, Conversation] = OrderedDict()
        self._index: dict[bytes | str, tuple[str, int]] = {}
        #: Keys two live conversations produced: they match neither (bounded, oldest dropped).
        self._ambiguous: OrderedDict[bytes | str, None] = OrderedDict()
        self.evicted = 0
        self.collisions = 0

    def __len__(self) -> int:
        return len(self._by_session)

    def session(self, session_id: str) -> Conversation | None:
        """The conversation of ``session_id`` (marked recently used), or None."""
        conv = self._by_session.get(session_id)
        if conv is not None:
            self._by_session.move_to_end(session_id)
        return conv

    def match(self, keys: Iterable[bytes | str]) -> tuple[Conversation, int] | None:
        """The conversation of the first key (in the order given) that names one, and the turn
        whose reply stored that key; or None."""
        for key in keys:
            found = self._index.get(key)
            if found is not None:
                conv = self.session(found[0])
                if conv is not None:
                    return conv, found[1]
        return None

    def record(self, conv: Conversation, keys: Iterable[bytes | str] = (), turn: int = 0) -> None:
        """Keep ``conv`` (most recently used) and make ``keys`` (stored by turn ``turn``'s reply)
        find it; a key another live conversation holds finds neither from now on."""
        self._by_session[conv.session_id] = conv
        self._by_session.move_to_end(conv.session_id)
        for key in keys:
            if key in self._ambiguous:
                continue
            owner = self._index.get(key)
            if owner is not None and owner[0] != conv.session_id:
                del self._index[key]
                self._ambiguous[key] = None
                self.collisions += 1
                while len(self._ambiguous) > self.max_conversations:
                    self._ambiguous.popitem(last=False)
                continue
            if owner is None:
                if len(conv.keys) == conv.keys.maxlen:  # its oldest key stops finding it
                    self._unindex(conv.keys[0][0], conv.session_id)
                conv.keys.append((key, turn))
                self._index[key] = (conv.session_id, turn)
        while len(self._by_session) > self.max_conversations:
            _sid, old = self._by_session.popitem(last=False)
            for key, _turn in old.keys:
                self._unindex(key, old.session_id)
            self.evicted += 1

    def _unindex(self, key: bytes | str, session_id: str) -> None:
        owner = self._index.get(key)
        if owner is not None and owner[0] == session_id:
            del self._index[key]

    def stats(self) -> dict[str, int]:
        return {
            "conversations": len(self._by_session),
            "keys": len(self._index),
            "evicted": self.evicted,
            "collisions": self.collisions,
        }
