"""When a launched run's child dies: restart it after a backoff, within a budget, or give up.

The pieces of recovery are the services' own (leases expire or are given back, outcome reports
are idempotent, the learner resumes bit-exactly from its checkpoint, the evaluator catches up
from its records, the tracker's Redis keeps an append-only file); this module only decides
*when* a dead child starts again and when to stop trying.

The budget is per process and per sliding window: a process may die `max_restarts` times within
`window_seconds` and be restarted each time; one more death within the window ends the run. A
process that dies at once on every start (a broken config, a missing file) thus spends its
budget in about the sum of its backoffs and the run stops with its log, while a process that
dies now and then over a week-long run is restarted for as long as the deaths stay apart.

The delay before restart k within the window is `backoff_seconds * 2**(k-1)`, at most
`max_backoff_seconds` (spopp.retry's schedule, without jitter: one process, nobody to fall in
step with). Deaths older than the window are forgotten, so after a quiet window the delay is
short again.
"""

from __future__ import annotations

import signal
from collections import deque

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from spopp.retry import backoff


class SupervisionSettings(BaseModel):
    """The `supervision` section of a launch file."""

    model_config = ConfigDict(extra="forbid")

    enabled: StrictBool = Field(True, description="restart children that die; false: any death ends the run")
    max_restarts: StrictInt = Field(
        5, ge=0, le=1000, description="restarts of one process allowed within window_seconds"
    )
    window_seconds: float = Field(
        600.0, gt=0, le=7 * 86_400, description="the sliding window of the restart budget, in seconds"
    )
    backoff_seconds: float = Field(1.0, gt=0, le=3600, description="delay before a first restart")
    max_backoff_seconds: float = Field(30.0, gt=0, le=3600, description="longest delay before a restart")

    @model_validator(mode="after")
    def _ordered(self) -> SupervisionSettings:
        if self.max_backoff_seconds < self.backoff_seconds:
            raise ValueError(
                f"max_backoff_seconds ({self.max_backoff_seconds:g}) is below backoff_seconds "
                f"({self.backoff_seconds:g})"
            )
        return self


def describe_exit(code: int | None) -> str:
    """`code 3`, or `SIGKILL` for a process killed by a signal (Popen's negative code)."""
    if code is None:
        return "no exit (still running)"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


class GaveUp(RuntimeError):
    """A process's restart budget is spent; the message (after the name) says how often it died and its last exit."""


class RestartBudget:
    """Per-process restart decisions. `death(name, code, now)` answers the delay before the
    restart, or raises GaveUp when this death is one too many within the window."""

    def __init__(self, settings: SupervisionSettings) -> None:
        self.s = settings
        self._deaths: dict[str, deque[float]] = {}  # per process, the times of its deaths in the window

    def death(self, name: str, code: int | None, now: float) -> float:
        deaths = self._deaths.setdefault(name, deque())
        while deaths and now - deaths[0] > self.s.window_seconds:
            deaths.popleft()
        deaths.append(now)
        if len(deaths) > self.s.max_restarts:
            raise GaveUp(
                f"died {len(deaths)} times in {now - deaths[0]:.0f} s, more than the "
                f"{self.s.max_restarts} restarts that supervision allows within {self.s.window_seconds:g} s; "
                f"its last exit: {describe_exit(code)}"
            )
        return backoff(self.s.backoff_seconds, self.s.max_backoff_seconds, len(deaths) - 1)
