"""Transparent mode reads the server's reply as it passes: did the turn end in tool calls, which?

:class:`ReplyReader` is fed the response body chunk by chunk, exactly as it goes to the client
(nothing is held back), and reports the tool calls of the reply plus the canonical entries the
client will append to its message list (``transparent.py``):

* Chat Completions, JSON: ``choices[0].message`` (``tool_calls``: id, function name). A named
  ``tool_choice`` answers ``finish_reason: "stop"`` with the calls, so the calls decide, not the
  finish reason.
* Chat Completions, SSE: ``choices[0].delta`` accumulated (content; ``tool_calls`` deltas by
  ``index``: id, name, argument pieces) until ``data: [DONE]``.
* Responses API, JSON: ``output`` items (``function_call``: ``call_id``, ``name``) and the
  response ``id``; SSE: the same from the ``response.completed`` event.

A reply cut off before its end (``finish_reason`` ``"length"``; a Responses API response with
status ``incomplete``) has no calls: their arguments are incomplete, the client cannot run them.

Only the first choice is followed (an agent sends ``n=1``). What the reader keeps is bounded by
``max_bytes``; past it, or on anything it cannot parse, it gives up and reports no reply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from tokencake.serving.transparent import Entry, chat_message_entry, responses_item_entry

__all__ = ["CUT_OFF", "ReplyReader", "SeenCall", "TurnReply", "chat_reply", "responses_reply"]


class SeenCall(NamedTuple):
    """One tool call of a reply."""

    call_id: str
    name: str


class TurnReply(NamedTuple):
    """What a reply adds to the conversation: its tool calls, the entries the client appends
    (canonical), the Responses API response id, and whether it was cut off (then no calls)."""

    calls: list[SeenCall]
    entries: list[Entry]
    response_id: str | None = None
    cut_off: bool = False


#: Finish reasons of a reply cut off before its end: a tool call in it is incomplete.
CUT_OFF = frozenset({"length"})


def _first_choice(doc: Mapping[str, Any]) -> Mapping[str, Any] | None:
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if isinstance(choice, Mapping) and choice.get("index", 0) == 0:
            return choice
    return None


def _chat_turn(content: Any, tool_calls: list[Any], finish_reason: Any) -> TurnReply:
    calls = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(call, Mapping) and isinstance(call.get("id"), str) and call["id"]:
            name = fn.get("name") if isinstance(fn, Mapping) else None
            calls.append(SeenCall(call["id"], name if isinstance(name, str) else ""))
    entry = chat_message_entry({"role": "assistant", "content": content, "tool_calls": tool_calls})
    if finish_reason in CUT_OFF:
        return TurnReply([], [entry], cut_off=True)
    return TurnReply(calls, [entry])


def chat_reply(doc: Any) -> TurnReply | None:
    """The turn of a Chat Completions JSON response (None: no choice to follow)."""
    choice = _first_choice(doc) if isinstance(doc, Mapping) else None
    if choice is None or not isinstance(choice.get("message"), Mapping):
        return None
    message = choice["message"]
    tool_calls = message.get("tool_calls")
    calls = tool_calls if isinstance(tool_calls, list) else []
    return _chat_turn(message.get("content"), calls, choice.get("finish_reason"))


def responses_reply(doc: Any) -> TurnReply | None:
    """The turn of a Responses API response object (None: not one)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("output"), list):
        return None
    entries, calls = [], []
    for item in doc["output"]:
        entry = responses_item_entry(item)
        if entry is not None:
            entries.append(entry)
        if isinstance(item, Mapping) and item.get("type") == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if isinstance(call_id, str) and call_id:
                calls.append(SeenCall(call_id, name if isinstance(name, str) else ""))
    response_id = doc.get("id") if isinstance(doc.get("id"), str) else None
    if doc.get("status") == "incomplete":
        return TurnReply([], entries, response_id, cut_off=True)
    return TurnReply(calls, entries, response_id)


class _ChatDeltas:
    """A streamed chat reply, accumulated from its first choice's deltas."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: Any = None
        #: Characters of content and arguments kept.
        self.size = 0

    def feed(self, event: Mapping[str, Any]) -> None:
        choice = _first_choice(event)
        if choice is not None and choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        delta = choice.get("delta") if choice is not None else None
        if not isinstance(delta, Mapping):
            return
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
            self.size += len(delta["content"])
        for call in delta.get("tool_calls") or []:
            if not isinstance(call, Mapping):
                continue
            index = call.get("index", 0) if isinstance(call.get("index", 0), int) else 0
            slot = self.calls.setdefault(index, {"id": "", "name": "", "args": []})
            if isinstance(call.get("id"), str) and call["id"]:
                slot["id"] = call["id"]
            fn = call.get("function")
            if isinstance(fn, Mapping):
                if isinstance(fn.get("name"), str) and fn["name"] and not slot["name"]:
                    slot["name"] = fn["name"]
                if isinstance(fn.get("arguments"), str):
                    slot["args"].append(fn["arguments"])
                    self.size += len(fn["arguments"])

    def turn(self) -> TurnReply:
        tool_calls = [
            {"id": s["id"], "function": {"name": s["name"], "arguments": "".join(s["args"])}}
            for _i, s in sorted(self.calls.items())
        ]
        return _chat_turn("".join(self.content), tool_calls, self.finish_reason)


class ReplyReader:
    """Reads one response body as it passes (see the module docstring).

    ``api`` is ``"chat"`` or ``"responses"``; ``stream`` whether the body is SSE. :meth:`feed`
    takes each chunk; :attr:`complete` turns true at the stream's terminal event (before that
    chunk is passed on, the caller can act on it); :meth:`turn` gives the result.
    """

    def __init__(self, api: str, *, stream: bool, max_bytes: int) -> None:
        self.api = api
        self.stream = stream
        self.max_bytes = max_bytes
        self.broken = False
        self.complete = False
        self._buffer = bytearray()
        self._chat = _ChatDeltas()
        self._turn: TurnReply | None = None

    def feed(self, chunk: bytes) -> None:
        """Take the next body chunk (never raises: what it cannot read makes it give up)."""
        if self.broken or self.complete or not chunk:
            return
        self._buffer += chunk
        try:
            if self.stream:
                self._events()
        except (ValueError, TypeError, AttributeError, KeyError, RecursionError):
            self._give_up()
            return
        # A JSON body is kept whole; a stream keeps its unfinished event and the reply so far.
        if len(self._buffer) + self._chat.size > self.max_bytes:
            self._give_up()

    def turn(self) -> TurnReply | None:
        """The reply's turn once the body is complete (None: none could be read)."""
        if self.broken:
            return None
        if self.stream:
            if self.api == "chat" and self._turn is None and self.complete:
                self._turn = self._chat.turn()
            return self._turn
        try:
            doc = json.loads(bytes(self._buffer))
        except (ValueError, RecursionError):
            return None
        return chat_reply(doc) if self.api == "chat" else responses_reply(doc)

    def _give_up(self) -> None:
        self.broken = True
        self._buffer = bytearray()

    def _events(self) -> None:
        """Parse every complete SSE event in the buffer."""
        while not self.complete:
            data = bytes(self._buffer).replace(b"\r\n", b"\n")
            end = data.find(b"\n\n")
            if end < 0:
                self._buffer = bytearray(data)
                return
            block, rest = data[:end], data[end + 2 :]
            self._buffer = bytearray(rest)
            lines = [ln[5:].removeprefix(b" ") for ln in block.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                self._event(b"\n".join(lines))

    def _event(self, payload: bytes) -> None:
        if payload.strip() == b"[DONE]":
            self.complete = True
            return
        event = json.loads(payload)
        if not isinstance(event, Mapping):
            return
        if self.api == "chat":
            if "error" in event and "choices" not in event:
                self._give_up()
                return
            self._chat.feed(event)
            return
        kind = event.get("type")
        if kind == "response.completed":
            self._turn = responses_reply(event.get("response"))
            self.complete = True
        elif kind in ("response.failed", "response.incomplete", "error"):
            self._give_up()
