"""Retrying calls to a service that may be restarting: capped exponential backoff with jitter,
bounded by time rather than by a count of attempts.

A bound in seconds says what users care about ("ride out a restart of up to five minutes")
whatever the backoff schedule, and it is the number the tracker's idempotency records must
outlive: a retried call carries the key of its first attempt, so the record must still be there
when the last retry lands. Jitter keeps many replicas that lost the same service from retrying
in lockstep when it comes back.

What is retried: connection-level failures (refused, reset, timed out) and the answers that mean
"not now" (502, 503, 504; a `Retry-After` header is honoured up to the cap). Every call that
goes through here must be idempotent: all of the tracker's state-changing routes are, and so is
the learner's intake (a repeated request_id counts once).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import httpx

RETRYABLE_ERRORS = (httpx.TransportError,)  # connect, read, write, pool, protocol errors and timeouts
RETRYABLE_STATUS = frozenset({502, 503, 504})
DEFAULT_RETRY_SECONDS = 300.0


def backoff(initial: float, cap: float, attempt: int) -> float:
    """The schedule every backoff in spopp follows: `initial` doubled per earlier attempt, at
    most `cap` (attempt 0 waits `initial`). A call's retries draw their jitter below it; the
    launcher's restarts wait it exactly (one process, nobody to fall in step with)."""
    return min(cap, initial * 2 ** min(attempt, 64))


@dataclass(frozen=True)
class RetryPolicy:
    """`max_seconds` after the first attempt, no further attempt starts; delays grow from
    `initial` by doubling up to `cap`, each drawn in [d/2, d] (jitter)."""

    max_seconds: float = DEFAULT_RETRY_SECONDS
    initial: float = 0.1
    cap: float = 5.0

    def __post_init__(self) -> None:
        if self.max_seconds < 0 or self.initial <= 0 or self.cap < self.initial:
            raise ValueError(f"invalid retry policy {self}")

    def start(self) -> Attempts:
        return Attempts(self)


@dataclass
class Attempts:
    """The state of one call's retries."""

    policy: RetryPolicy
    started: float = field(default_factory=time.monotonic)
    count: int = 0

    def next_delay(self, retry_after: float | None = None) -> float | None:
        """Seconds to wait before the next attempt, or None when the time bound is spent."""
        base = backoff(self.policy.initial, self.policy.cap, self.count)
        delay = random.uniform(base / 2, base)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.policy.cap))
        self.count += 1
        left = self.policy.max_seconds - (time.monotonic() - self.started)
        if left <= 0:
            return None
        return min(delay, left)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


def retry_after(response: httpx.Response) -> float | None:
    """The `Retry-After` header in seconds, when it is a number."""
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the backoff alone decides
