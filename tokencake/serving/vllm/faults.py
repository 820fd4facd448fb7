"""Copy fault injection for tests: ``TOKENCAKE_FAULTS`` makes the worker's copies fail or stall.

``TOKENCAKE_FAULTS="copy_fail=0.2,copy_stall_s=0.5,seed=1"`` makes copies fail (nothing
written, job failed → recompute) or stall (held back, then written late → timeout path); see
:func:`parse_faults`. A bad value logs one warning and injects nothing.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tokencake.serving.vllm._copy_backend import CopySubmitError
from tokencake.serving.vllm._inflight import JOB_KINDS, SubmittedCopy, describe

log = logging.getLogger("vllm.tokencake.worker")

FAULTS_ENV = "TOKENCAKE_FAULTS"
_FAULT_KEYS = ("copy_fail", "copy_stall", "copy_stall_s", "kinds", "seed")


@dataclass(frozen=True)
class Faults:
    """Copy faults to inject (``TOKENCAKE_FAULTS``), to exercise the failure paths end to end."""

    #: Probability that a copy fails before writing anything.
    copy_fail: float = 0.0
    #: Probability that a copy is held back ``copy_stall_s`` seconds (then written, late).
    copy_stall: float = 0.0
    copy_stall_s: float = 0.0
    #: Job kinds the faults apply to.
    kinds: frozenset[str] = JOB_KINDS
    #: Seed of the draws (None: a different sequence each run).
    seed: int | None = None

    @property
    def active(self) -> bool:
        return self.copy_fail > 0 or (self.copy_stall > 0 and self.copy_stall_s > 0)


def parse_faults(text: str) -> Faults | None:
    """Parse ``key=value`` pairs separated by commas; raises ``ValueError`` on any bad item.

    Keys: ``copy_fail`` (probability), ``copy_stall`` (probability, default 1 when
    ``copy_stall_s`` is given), ``copy_stall_s`` (seconds, at most 3600), ``kinds``
    (``offload+prefetch+load``, default all) and ``seed`` (int). Empty text: None.
    """
    values: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"{item.strip()!r} is not key=value")
        if key not in _FAULT_KEYS:
            raise ValueError(f"unknown key {key!r} (known: {', '.join(_FAULT_KEYS)})")
        if key in values:
            raise ValueError(f"{key} given twice")
        values[key] = value
    if not values:
        return None

    def number(key: str, hi: float) -> float:
        v = float(values[key])
        if not (math.isfinite(v) and 0.0 <= v <= hi):
            raise ValueError(f"{key}={values[key]} must be in [0, {hi:g}]")
        return v

    stall_s = number("copy_stall_s", 3600.0) if "copy_stall_s" in values else 0.0
    default_stall = 1.0 if stall_s > 0 else 0.0
    kinds = JOB_KINDS
    if "kinds" in values:
        kinds = frozenset(k.strip() for k in values["kinds"].split("+"))
        if not kinds or not kinds <= JOB_KINDS:
            raise ValueError(f"kinds={values['kinds']} must be a '+'-list of {'/'.join(sorted(JOB_KINDS))}")
    return Faults(
        copy_fail=number("copy_fail", 1.0) if "copy_fail" in values else 0.0,
        copy_stall=number("copy_stall", 1.0) if "copy_stall" in values else default_stall,
        copy_stall_s=stall_s,
        kinds=kinds,
        seed=int(values["seed"]) if "seed" in values else None,
    )


def faults_from_env(environ: Mapping[str, str] | None = None) -> Faults | None:
    """The faults ``TOKENCAKE_FAULTS`` asks for; a bad value logs one warning and injects none."""
    text = (os.environ if environ is None else environ).get(FAULTS_ENV, "")
    if not text.strip():
        return None
    try:
        faults = parse_faults(text)
    except Exception as exc:  # a typo in a test knob must never take the worker down
        log.warning("TokenCake: ignoring %s=%r (%s); no faults injected", FAULTS_ENV, text, exc)
        return None
    if faults is not None and faults.active:
        log.warning("TokenCake: fault injection ON (%s=%s)", FAULTS_ENV, text)
    return faults


class InjectedFault(RuntimeError):
    """A copy failure asked for by ``TOKENCAKE_FAULTS``."""


class StalledCopy:
    """A copy held back ``due - now`` seconds (fault injection): nothing is written before it is
    submitted, when it is due, as if a real copy were still running that long."""

    def __init__(
        self,
        submit: Callable[[], SubmittedCopy],
        due: float,
        nbytes: int,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> None:
        self._submit, self._due, self.nbytes = submit, due, nbytes
        self._clock, self._sleep = clock, sleep
        self._handle: SubmittedCopy | None = None
        #: The submit failed after part of the copy was queued: the job fails once that part ran.
        self.error: str | None = None

    def _start(self) -> SubmittedCopy:
        if self._handle is None:
            try:
                self._handle = self._submit()
            except CopySubmitError as exc:  # wait for the queued part, as an unstalled copy does
                self._handle, self.error = exc.handle, describe(exc)
        return self._handle

    def done(self) -> bool:
        if self._handle is None and self._clock() < self._due:
            return False
        return self._start().done()

    def wait(self) -> None:
        if self._handle is None:
            left = self._due - self._clock()
            if left > 0:
                self._sleep(left)
        self._start().wait()

    def order_before_compute(self) -> None:
        self.wait()  # a held-back copy cannot be stream-ordered before it exists
        self._start().order_before_compute()

    @property
    def seconds(self) -> float:
        return self._handle.seconds if self._handle is not None else 0.0


__all__ = ["FAULTS_ENV", "Faults", "InjectedFault", "StalledCopy", "faults_from_env", "parse_faults"]
