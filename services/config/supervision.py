"""The `supervision` section of a launch file: how the launcher restarts children that die.

Apart from services/launch/supervise.py (which acts on it) so that the launch settings
(services/config/launch.py) can hold it without importing the supervisor.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator


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
