"""``Retry``: how often, after how long and on which exceptions a tool or an LLM call is tried again.

Retrying at once hammers a service that is already struggling, and many clients retrying in
lock-step keep it down; exponential backoff with jitter spreads the attempts out. ``retry_on``
keeps bugs (a ``KeyError`` in a tool) from being retried as if they were outages.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import openai

ExceptionTypes = tuple[type[BaseException], ...]

#: What an LLM call retries by default: the failures a second attempt can fix.
LLM_TRANSIENT_ERRORS: ExceptionTypes = (
    openai.APIConnectionError,  # includes timeouts
    openai.RateLimitError,
    openai.InternalServerError,
    openai.ConflictError,
)
#: What a tool retries by default (any failure, as before ``retry_on`` existed).
TOOL_ERRORS: ExceptionTypes = (Exception,)


@dataclass(frozen=True)
class Retry:
    """A retry policy: ``retries`` extra attempts, each after an exponentially growing, jittered delay.

    The delay before retry ``n`` (1-based) is ``min(max_backoff, backoff * multiplier ** (n - 1))``
    scaled by a random factor in ``[1 - jitter, 1]``. ``retry_on`` lists the exception types worth
    another attempt; ``None`` means the default of where the policy is used (tools: any
    ``Exception``; LLM calls: connection errors, timeouts, 429, 409 and 5xx).
    """

    retries: int = 2
    retry_on: ExceptionTypes | None = None
    backoff: float = 0.2
    multiplier: float = 2.0
    max_backoff: float = 10.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.retries, int) or isinstance(self.retries, bool) or self.retries < 0:
            raise ValueError(f"Retry.retries must be an int >= 0, got {self.retries!r}")
        for name in ("backoff", "max_backoff"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Retry.{name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.multiplier, int | float) and self.multiplier >= 1):
            raise ValueError(f"Retry.multiplier must be >= 1, got {self.multiplier!r}")
        if not (isinstance(self.jitter, int | float) and 0 <= self.jitter <= 1):
            raise ValueError(f"Retry.jitter must be in [0, 1], got {self.jitter!r}")
        if self.retry_on is not None:
            object.__setattr__(self, "retry_on", exception_types(self.retry_on, "Retry.retry_on"))

    @property
    def attempts(self) -> int:
        """Attempts in total (the first one plus the retries)."""
        return self.retries + 1

    def delay(self, retry: int, *, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1 = the second attempt)."""
        base = min(self.max_backoff, self.backoff * self.multiplier ** max(0, retry - 1))
        if self.jitter:
            base *= 1.0 - self.jitter * (rng or random).random()
        return base

    def should_retry(self, exc: BaseException, attempt: int, default: ExceptionTypes) -> bool:
        """True when ``exc`` ended attempt ``attempt`` (1-based) and another attempt is allowed."""
        return attempt <= self.retries and isinstance(exc, self.retry_on or default)


def exception_types(value: Any, what: str) -> ExceptionTypes:
    """``value`` (one exception type or a sequence of them) as a tuple, or ``TypeError`` naming ``what``."""
    items = (value,) if isinstance(value, type) else value
    if not isinstance(items, Sequence) or isinstance(items, str) or not items:
        raise TypeError(f"{what} must be an exception type or a non-empty tuple of them, got {value!r}")
    for item in items:
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise TypeError(f"{what}: {item!r} is not an exception type")
    return tuple(items)


def as_retry(value: Retry | int | None, *, retry_on: Any = None, what: str) -> Retry | None:
    """Normalize a ``retries``/``retry`` option: an int is ``Retry(value)``; ``retry_on`` overrides."""
    if value is None:
        policy = None
    elif isinstance(value, Retry):
        policy = value
    elif isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{what} must be >= 0, got {value}")
        policy = Retry(value)
    else:
        raise TypeError(f"{what} must be an int or a tc.Retry, got {type(value).__name__}")
    if retry_on is not None:
        policy = dataclasses.replace(policy or Retry(0), retry_on=exception_types(retry_on, "retry_on"))
    return policy
