"""``Supervisor``: restarts with backoff, a bounded budget, and when the deployment has failed.

The members are plain objects (no processes): ``check`` is called by hand with a fake clock.
"""

from __future__ import annotations

import pytest

from tokencake.serving.supervisor import Member, RestartPolicy, Supervisor


class Proc:
    """A stand-in process: ``alive`` until killed; ``restart`` fails ``fail_next`` times first."""

    def __init__(self, name: str, **kw: object) -> None:
        self.alive = True
        self.code: int | None = None
        self.fail_next = 0
        self.starts = 0
        self.member = Member(
            name,
            alive=lambda: self.alive,
            exit_code=lambda: self.code,
            restart=self.restart,
            info=lambda: {"url": f"http://{name}"},
            **kw,  # type: ignore[arg-type]
        )

    def kill(self, code: int = 137) -> None:
        self.alive, self.code = False, code

    def restart(self) -> None:
        self.starts += 1
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("port busy\nsecond line")
        self.alive, self.code = True, None


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def supervised(*procs: Proc, **policy: float) -> tuple[Supervisor, Clock, list[str]]:
    clock, lines = Clock(), []
    sup = Supervisor([p.member for p in procs], RestartPolicy(**policy), say=lines.append, clock=clock)  # type: ignore[arg-type]
    return sup, clock, lines


def step(sup: Supervisor, clock: Clock, dt: float = 0.0) -> None:
    clock.t += dt
    sup.check()
    sup.join_restarts(5)


def test_a_dead_member_is_restarted_after_its_backoff_and_counted() -> None:
    a, b = Proc("replica-0"), Proc("replica-1")
    sup, clock, lines = supervised(a, b, backoff_s=2.0)
    step(sup, clock)
    assert a.starts == 0 and sup.status()["failure"] is None
    a.kill(137)
    step(sup, clock)
    assert a.member.state == "waiting" and a.starts == 0  # not before its backoff
    step(sup, clock, 1.0)
    assert a.starts == 0
    step(sup, clock, 1.5)
    assert a.starts == 1 and a.member.state == "up" and a.alive
    status = {m["name"]: m for m in sup.status()["members"]}
    assert status["replica-0"] == {
        "name": "replica-0",
        "state": "up",
        "up": True,
        "restarts": 1,
        "failed_restarts": 0,
        "last_exit": 137,
        "last_error": None,
        "last_outage_s": 2.5,
        "url": "http://replica-0",
    }
    assert status["replica-1"]["restarts"] == 0 and b.starts == 0
    assert lines[0] == "replica-0 exited (code 137)" and lines[-1] == "replica-0 is back (down 2 s)"


def test_failed_restarts_back_off_and_the_budget_gives_a_member_up() -> None:
    router = Proc("router", essential=True)
    sup, clock, lines = supervised(router, max_restarts=3, window_s=600.0, backoff_s=1.0, max_backoff_s=3.0)
    router.fail_next = 10
    router.kill(1)
    step(sup, clock)
    waits = []
    for _ in range(100):
        if router.member.state == "failed":
            break
        waits.append(router.member.next_try_at - clock.t)
        step(sup, clock, waits[-1])
    assert waits == [1.0, 2.0, 3.0]  # doubling, capped at max_backoff_s
    assert router.starts == 3 and router.member.failed_restarts == 3
    assert router.member.last_error == "port busy"  # first line only
    assert sup.failure == "router could not be kept running (port busy)"
    assert "given up: 3 restart(s) in the last 600 s" in lines[-1]
    step(sup, clock, 100.0)
    assert router.starts == 3  # a member given up stays down


def test_the_budget_is_per_window() -> None:
    a = Proc("replica-0", group="the replicas")
    sup, clock, _ = supervised(a, max_restarts=2, window_s=60.0, backoff_s=0.0)
    for _ in range(2):
        a.kill()
        step(sup, clock)
        step(sup, clock)
        clock.t += 20
    a.kill()
    step(sup, clock)
    assert a.member.state == "failed"  # the third death within 60 s
    b = Proc("replica-0", group="the replicas")
    sup, clock, _ = supervised(b, max_restarts=2, window_s=60.0, backoff_s=0.0)
    for _ in range(5):  # deaths 61 s apart: each window holds one restart
        b.kill()
        step(sup, clock)
        step(sup, clock)
        assert b.member.state == "up"
        clock.t += 61
    assert b.member.restarts == 5


def test_the_deployment_fails_only_when_every_replica_is_given_up() -> None:
    a, b = Proc("replica-0", group="the replicas"), Proc("replica-1", group="the replicas")
    router = Proc("router", essential=True)
    sup, clock, _ = supervised(a, b, router, max_restarts=0)
    a.kill()
    step(sup, clock)
    assert a.member.state == "failed" and sup.failure is None  # replica-1 still serves
    b.kill()
    step(sup, clock)
    assert sup.failure == "every member of the replicas was given up"


def test_nothing_is_restarted_once_stopping() -> None:
    a = Proc("replica-0")
    sup, clock, _ = supervised(a, backoff_s=0.0)
    a.kill()
    sup.stop()
    step(sup, clock, 10.0)
    assert a.starts == 0


def test_a_member_whose_status_fails_still_reports() -> None:
    m = Member("x", alive=lambda: True, exit_code=lambda: None, restart=lambda: None, info=lambda: 1 / 0)
    assert Supervisor([m]).status()["members"][0]["info_error"] == "ZeroDivisionError"


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError):
        RestartPolicy(backoff_s=5.0, max_backoff_s=1.0)
    assert RestartPolicy(backoff_s=1.0, max_backoff_s=30.0).delay(10) == 30.0
