"""Property-based tests of the event API: hostile bodies never break it, the stall book stays sound.

The events listener runs inside vLLM's EngineCore, so anything a client can send must end in a
200 or a 4xx ack, never an exception or a 5xx. Behind it, ``SessionTracker`` is checked against a
small reference model of ``docs/events.md``'s ack table: every ack code, which events queue a
transition (a rejected or duplicate one never does), each stall ended at most once, active stalls
within their cap and the retained block hashes within their byte budget.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from pydantic import ValidationError

from tokencake.events import EventAck, parse_event
from tokencake.serving.event_api import EventServer, http_status
from tokencake.serving.sessions import SessionTracker

#: Statuses a client may ever see for an event (5xx would mean the extension broke).
EVENT_STATUSES = {200, 400, 401, 404, 405, 409, 413}

BEGIN: dict[str, Any] = {
    "type": "stall_begin",
    "v": 1,
    "stall_id": "s-0",
    "session_id": "run:a",
    "run_id": "run",
    "node": "a",
    "tool": "search",
    "predicted_s": 2.0,
    "ts": 1.0,
}
END: dict[str, Any] = {
    "type": "stall_end",
    "v": 1,
    "stall_id": "s-0",
    "session_id": "run:a",
    "run_id": "run",
    "node": "a",
    "tool": "search",
    "duration_s": 1.0,
    "ts": 2.0,
}

# ------------------------------------------------------------------------------ strategies

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)
#: Values that are plausible for an event field, and many that are not.
field_values = (
    json_values
    | st.sampled_from(["", "x", "s-1", "run:a", "stall_begin", "stall_end", "ok", "bogus"])
    | st.floats(min_value=-10.0, max_value=1e6)
    | st.integers(min_value=-3, max_value=3)
    | st.text(min_size=190, max_size=450)
)


@st.composite
def mutated_events(draw: st.DrawFn) -> dict[str, Any]:
    """A valid begin or end with some fields replaced, dropped, or extra keys added."""
    event = dict(draw(st.sampled_from([BEGIN, END])))
    keys = sorted(set(BEGIN) | set(END) | {"stages", "attempt", "outcome", "error", "agent_type", "kind"})
    for key in draw(st.lists(st.sampled_from(keys), max_size=4, unique=True)):
        if draw(st.booleans()):
            event.pop(key, None)
        else:
            event[key] = draw(field_values)
    event.update(draw(st.dictionaries(st.text(max_size=10), json_values, max_size=2)))
    return event


def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


bodies = (
    st.binary(max_size=300)
    | json_values.map(_dumps)
    | mutated_events().map(_dumps)
    | st.lists(mutated_events(), max_size=3).map(_dumps)
    | st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass"))
)


def _check_ack(ack: EventAck) -> int:
    """The ack is well formed and maps to 200 or a 4xx; returns its HTTP status."""
    assert isinstance(ack, EventAck)
    status = http_status(ack)
    assert status in EVENT_STATUSES, ack
    assert ack.ok == (status == 200)
    assert ack.ok == (ack.status in ("recorded", "duplicate"))
    if not ack.ok:
        assert ack.status == "rejected" and ack.reason, ack
    return status


# ------------------------------------------------------------------- stateless: any body


@settings(max_examples=300, deadline=None)
@given(body=bodies)
def test_any_body_answers_200_or_4xx_and_rejections_queue_nothing(body: bytes) -> None:
    tracker = SessionTracker()
    tracker.record_request("run:a", [b"\x01" * 32, b"\x02" * 32], 256)
    server = EventServer("127.0.0.1", 0, tracker.apply)  # not started: the same code path, no socket
    ack = server.handle_event_body(body)
    status = _check_ack(ack)
    transitions = tracker.drain()
    if status != 200 or ack.status == "duplicate":
        assert transitions == []
    else:
        assert len(transitions) == 1
    assert tracker.stats()["active_stalls"] <= 1
    assert tracker.retained_bytes <= tracker.max_bytes


# ------------------------------------------------------------- over HTTP, on a real socket


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[str, str, bytes, dict[str, str]]:
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET"]))
    path = draw(
        st.sampled_from(["/v1/events", "/v1/events", "/v1/events?x=1", "/v1/stats", "/health", "/nope"])
        | st.text(alphabet="abc/?=&-_.", max_size=20).map(lambda s: "/p" + s)
    )
    body = draw(bodies | st.just(b"x" * (64 * 1024 + 1)))
    headers: dict[str, str] = {}
    auth = draw(st.sampled_from(["good", "bad", "none", "garbage"]))
    if auth == "good":
        headers["Authorization"] = "Bearer k3y"
    elif auth == "bad":
        headers["Authorization"] = "Bearer nope"
    elif auth == "garbage":
        headers["Authorization"] = draw(st.text(alphabet="abcXYZ01=:.", min_size=1, max_size=30))
    if draw(st.booleans()):
        headers["Content-Type"] = draw(st.sampled_from(["application/json", "text/plain", "x/y"]))
    return method, path, body, headers


@contextlib.contextmanager
def _serve(api_key: str | None) -> Iterator[tuple[EventServer, httpx.Client]]:
    """A started listener over a real tracker, and a keep-alive client."""
    tracker = SessionTracker()
    tracker.record_request("run:a", [b"\x01" * 32], 128)
    server = EventServer("127.0.0.1", 0, tracker.apply, stats_fn=tracker.stats, api_key=api_key)
    with server, httpx.Client(base_url=server.url, timeout=10.0) as client:
        yield server, client


def _http_property(server: EventServer, client: httpx.Client, api_key: str | None) -> None:
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(req=http_requests())
    def one(req: tuple[str, str, bytes, dict[str, str]]) -> None:
        method, path, body, headers = req
        resp = client.request(method, path, content=body if method == "POST" else None, headers=headers)
        assert resp.status_code == 200 or 400 <= resp.status_code < 500, (resp.status_code, resp.text)
        data = resp.json()
        assert isinstance(data, dict)
        if resp.status_code != 200:
            assert data.get("ok") is False and data.get("reason"), data
        route = path.split("?", 1)[0]
        authorized = headers.get("Authorization") == f"Bearer {api_key}"
        if api_key and not authorized and (route, method) in (("/v1/events", "POST"), ("/v1/stats", "GET")):
            assert resp.status_code == 401, (resp.status_code, data)

    one()


def test_http_listener_answers_only_200_or_4xx_and_stays_healthy() -> None:
    """Random GET/POSTs, paths, bodies (including > 64 KiB) and auth headers over one socket."""
    for api_key in (None, "k3y"):
        with _serve(api_key) as (server, client):
            _http_property(server, client, api_key)
            assert client.get("/health").status_code == 200
            counters = server.metrics.snapshot()["counters"]
            assert "internal_errors" not in counters and "handler_errors" not in counters, counters


def test_other_http_methods_get_a_json_4xx() -> None:
    """PUT/DELETE/PATCH/HEAD-less methods are client errors too (docs/events.md: only 200/4xx)."""
    with _serve(None) as (_server, client):
        for method in ("PUT", "DELETE", "PATCH", "OPTIONS"):
            resp = client.request(method, "/v1/events", content=b"{}")
            assert 400 <= resp.status_code < 500, (method, resp.status_code, resp.text[:200])
            assert resp.json().get("ok") is False


# ----------------------------------------------------- stateful: the tracker vs a model

STALL_IDS = [f"s-{i}" for i in range(40)]
SESSIONS = [f"r{i}:a" for i in range(3)]


class StallBook(RuleBasedStateMachine):
    """Events in random order, ids, sessions and versions, through the real body parser.

    The model holds what ``docs/events.md`` says the server knows: active stalls (id → session),
    finished ones (id → session, state, whether an end was seen) and lone ends. Expiries the
    tracker decides itself (active-stall cap, byte budget, age) arrive as ``expired`` transitions;
    the model learns them there, after checking that they name an active stall.
    """

    MAX_ACTIVE = 3
    MAX_BYTES = 2048

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.tracker = SessionTracker(
            max_sessions=2,
            max_active_stalls=self.MAX_ACTIVE,
            max_finished_stalls=10_000,
            max_orphan_ends=10_000,
            max_bytes=self.MAX_BYTES,
            max_stall_age_s=100.0,
            session_ttl_s=50.0,
            clock=lambda: self.now,
        )
        self.server = EventServer("127.0.0.1", 0, self.tracker.apply)
        self.active: dict[str, str] = {}
        #: stall id -> [session, state ("ended" | "expired" | "rejected"), end seen]
        self.finished: dict[str, list[Any]] = {}
        self.orphans: dict[str, str] = {}

    # ---- helpers
    def _learn(self, transitions: list[Any], *, allowed: set[tuple[str, str]]) -> None:
        """Check the transitions queued by one operation and fold expiries into the model."""
        for tr in transitions:
            if tr.kind == "expired":
                assert tr.stall_id in self.active, f"expired transition for a non-active stall {tr.stall_id}"
                assert self.active[tr.stall_id] == tr.session_id
                del self.active[tr.stall_id]
                self.finished[tr.stall_id] = [tr.session_id, "expired", False]
                continue
            assert (tr.kind, tr.stall_id) in allowed, f"unexpected {tr.kind} transition for {tr.stall_id}"
            allowed.discard((tr.kind, tr.stall_id))
        assert not allowed, f"missing transitions {allowed}"

    def _send(self, payload: dict[str, Any]) -> tuple[int, EventAck]:
        ack = self.server.handle_event_body(json.dumps(payload).encode())
        return _check_ack(ack), ack

    # ---- rules
    @rule(session=st.sampled_from(SESSIONS), n_blocks=st.integers(0, 40), salt=st.integers(0, 3))
    def record_request(self, session: str, n_blocks: int, salt: int) -> None:
        hashes = [bytes([salt, i % 256]) * 16 for i in range(n_blocks)]
        self.tracker.record_request(session, hashes, n_blocks * 128 + 5)
        self._learn(self.tracker.drain(), allowed=set())
        kept = self.tracker.session(session)  # the newest session is never the one evicted
        assert kept is not None and kept.nbytes <= self.MAX_BYTES
        assert list(kept.block_hashes) == hashes[: len(kept.block_hashes)]  # a too-long chain keeps its head

    def _pick(self, data: st.DataObject, *, fresh: bool = False) -> tuple[str, str]:
        """A stall id (new, known to the server, or active) and a session (usually the stall's own)."""
        known = sorted(set(self.active) | set(self.finished) | set(self.orphans))
        pools = {
            "new": [s for s in STALL_IDS if s not in known],
            "known": known,
            "active": sorted(self.active),
        }
        choices = ["new", "new", "known", "active"] if fresh else ["new", "known", "active", "active"]
        which = data.draw(st.sampled_from(choices))
        stall_id = data.draw(st.sampled_from(pools[which] or known or STALL_IDS))
        own = self.active.get(stall_id) or (self.finished.get(stall_id) or [None])[0]
        own = own or self.orphans.get(stall_id)
        if own is not None and data.draw(st.integers(0, 3)) > 0:
            return stall_id, own
        return stall_id, data.draw(st.sampled_from(SESSIONS))

    @rule(
        data=st.data(),
        predicted=st.none() | st.floats(0, 86400),
        version=st.sampled_from([1, 1, 1, 1, 2, 0]),
    )
    def begin(self, data: st.DataObject, predicted: float | None, version: int) -> None:
        stall_id, session = self._pick(data, fresh=True)
        known_blocks = self.tracker.session(session)
        payload = {
            **BEGIN,
            "stall_id": stall_id,
            "session_id": session,
            "v": version,
            "predicted_s": predicted,
        }
        status, ack = self._send(payload)
        allowed: set[tuple[str, str]] = set()
        if version != 1:
            expected = (400, "unsupported_version")
        elif stall_id in self.active or stall_id in self.finished:
            known_session = self.active[stall_id] if stall_id in self.active else self.finished[stall_id][0]
            if known_session != session:
                expected = (409, "stall_conflict")
            elif stall_id in self.finished and self.finished[stall_id][1] == "rejected":
                expected = (409, "end_before_begin")
            else:
                expected = (200, "duplicate")
        elif stall_id in self.orphans:
            del self.orphans[stall_id]
            self.finished[stall_id] = [session, "rejected", False]
            expected = (409, "end_before_begin")
        else:
            expected = (200, "recorded")
            self.active[stall_id] = session
            allowed.add(("begin", stall_id))
            if version == 1 and ack.ok:  # the decision the ack can know (docs/policy.md §5)
                blocks = known_blocks
                decision = (
                    "unknown_session" if blocks is None else None if blocks.block_hashes else "no_blocks"
                )
                assert ack.decision == decision, (ack, blocks)
        got = (status, ack.status if ack.ok else ack.reason)
        assert got == expected, (payload, ack)
        self._learn(self.tracker.drain(), allowed=allowed)

    @rule(data=st.data(), duration=st.floats(0, 1e6), version=st.sampled_from([1, 1, 1, 1, 3]))
    def end(self, data: st.DataObject, duration: float, version: int) -> None:
        stall_id, session = self._pick(data)
        payload = {**END, "stall_id": stall_id, "session_id": session, "v": version, "duration_s": duration}
        status, ack = self._send(payload)
        allowed: set[tuple[str, str]] = set()
        if version != 1:
            expected = (400, "unsupported_version")
        elif stall_id in self.active:
            if self.active[stall_id] != session:
                expected = (409, "session_mismatch")
            else:
                expected = (200, "recorded")
                del self.active[stall_id]
                self.finished[stall_id] = [session, "ended", True]
                allowed.add(("end", stall_id))
        elif stall_id in self.finished:
            rec = self.finished[stall_id]
            if rec[0] != session:
                expected = (409, "session_mismatch")
            elif rec[1] == "expired" and not rec[2]:
                expected = (200, "recorded")
                rec[2] = True
                assert ack.decision == "expired", ack
            else:
                expected = (200, "duplicate")
        else:
            self.orphans[stall_id] = session
            expected = (404, "unknown_stall")
        got = (status, ack.status if ack.ok else ack.reason)
        assert got == expected, (payload, ack)
        self._learn(self.tracker.drain(), allowed=allowed)

    @rule(body=bodies)
    def garbage(self, body: bytes) -> None:
        """A body that is not a valid version-1 event changes nothing and queues nothing."""
        try:
            valid_v1 = parse_event(body).v == 1
        except (ValidationError, ValueError):
            valid_v1 = False
        assume(not valid_v1)  # valid events go through the begin/end rules and the model
        before = self.tracker.stats()
        status = _check_ack(self.server.handle_event_body(body))
        assert status == 400
        assert self.tracker.drain() == []
        after = self.tracker.stats()
        assert (after["active_stalls"], after["finished_stalls"]) == (
            before["active_stalls"],
            before["finished_stalls"],
        )

    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        stall_id, _session = self._pick(data)
        rec = self.tracker.expire(stall_id, "test")
        if stall_id in self.active:
            assert rec is not None and rec.state == "expired"
            self.finished[stall_id] = [self.active.pop(stall_id), "expired", False]
        else:
            assert rec is None
        self._learn(self.tracker.drain(), allowed=set())

    @rule(dt=st.floats(0, 40))
    def advance_and_sweep(self, dt: float) -> None:
        self.now += dt
        old = self.tracker.sweep()
        transitions = self.tracker.drain()
        assert sorted(old) == sorted(tr.stall_id for tr in transitions)
        self._learn(transitions, allowed=set())

    @rule(session=st.sampled_from(SESSIONS))
    def forget(self, session: str) -> None:
        self.tracker.forget_session(session)

    # ---- invariants
    @invariant()
    def bounds_hold(self) -> None:
        stats = self.tracker.stats()
        assert stats["active_stalls"] <= self.MAX_ACTIVE
        assert stats["active_stalls"] == len(self.active), (stats, self.active)
        assert 0 <= self.tracker.retained_bytes <= self.MAX_BYTES
        assert stats["pending_transitions"] == 0
        assert {r.stall_id for r in self.tracker.active_stalls()} == set(self.active)

    def teardown(self) -> None:
        """Ending every stall and forgetting every session frees every retained byte."""
        for stall_id, session in list(self.active.items()):
            status, _ack = self._send({**END, "stall_id": stall_id, "session_id": session})
            assert status == 200
        for session in SESSIONS:
            self.tracker.forget_session(session)
        assert self.tracker.stats()["active_stalls"] == 0
        assert self.tracker.retained_bytes == 0


StallBook.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_stall_book = StallBook.TestCase


# ------------------------------------------------- concurrent delivery (the listener's threads)


@st.composite
def event_storms(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Begins and ends of a few stalls, duplicated, reordered and with some wrong sessions."""
    events: list[dict[str, Any]] = []
    for i in range(draw(st.integers(1, 8))):
        session = draw(st.sampled_from(SESSIONS))
        ids = {"stall_id": f"c-{i}", "session_id": session}
        events.append({**BEGIN, **ids})
        if draw(st.booleans()):
            events.append({**END, **ids, "duration_s": draw(st.floats(0, 100))})
        if draw(st.booleans()):
            events.append({**BEGIN, **ids, "session_id": draw(st.sampled_from(SESSIONS))})
    return draw(st.permutations(events))


@settings(max_examples=60, deadline=None)
@given(events=event_storms(), threads=st.integers(2, 4))
def test_concurrent_events_keep_the_stall_book_sound(events: list[dict[str, Any]], threads: int) -> None:
    """Events applied from several threads at once, as the listener does: no exception, every
    stall queues one begin and at most one terminal transition, in that order, and the counts of
    accepted acks match the transitions queued."""
    tracker = SessionTracker(max_active_stalls=3, max_bytes=2048)
    for session in SESSIONS:
        tracker.record_request(session, [bytes([i]) * 32 for i in range(5)], 700)
    server = EventServer("127.0.0.1", 0, tracker.apply)
    acks: list[tuple[dict[str, Any], EventAck]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def worker(part: list[dict[str, Any]]) -> None:
        try:
            barrier.wait()
            for payload in part:
                ack = server.handle_event_body(json.dumps(payload).encode())
                with lock:
                    acks.append((payload, ack))
        except BaseException as exc:  # reported below: a thread must not swallow a failure
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(events[i::threads],)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=30)
    assert not errors, errors
    assert len(acks) == len(events)
    transitions = tracker.drain()
    kinds: dict[str, list[str]] = {}
    for tr in transitions:
        kinds.setdefault(tr.stall_id, []).append(tr.kind)
    for stall_id, seq in kinds.items():
        assert seq in (["begin"], ["begin", "end"], ["begin", "expired"]), (stall_id, seq)
    recorded_begins = sum(1 for p, a in acks if p["type"] == "stall_begin" and a.status == "recorded")
    recorded_ends = sum(
        1 for p, a in acks if p["type"] == "stall_end" and a.status == "recorded" and a.decision != "expired"
    )
    assert recorded_begins == sum(seq.count("begin") for seq in kinds.values())
    assert recorded_ends == sum(seq.count("end") for seq in kinds.values())
    for _payload, ack in acks:
        _check_ack(ack)
    stats = tracker.stats()
    assert stats["active_stalls"] <= 3
    assert stats["active_stalls"] == sum(1 for seq in kinds.values() if seq == ["begin"])
    assert tracker.retained_bytes <= tracker.max_bytes


# ------------------------------------------------------------- sanity of the strategies


def test_strategies_reach_accepted_and_rejected_events() -> None:
    """The body generator is not vacuous: it yields accepted events as well as rejected ones."""
    seen: set[int] = set()

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(body=bodies)
    def sample(body: bytes) -> None:
        tracker = SessionTracker()
        seen.add(_check_ack(EventServer("127.0.0.1", 0, tracker.apply).handle_event_body(body)))

    sample()
    assert {200, 400} <= seen, seen
