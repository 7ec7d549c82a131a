"""The run binding: what ties a process to one run. Every process that joins a run (a rollout replica,
the learner, the evaluator, the init step) takes the same three settings, with the same names,
bounds and variables:

    run        SPOPP_RUN          the run's name at the tracker
    tracker    SPOPP_TRACKER_URL  the tracker's base URL
    api_token  SPOPP_API_TOKEN    the bearer token of the tracker (and of the learner's intake)

They are read under these shared names, not `SPOPP_<SERVICE>_RUN`, so a deployment states them
once (compose's `x-run-binding`, the Kubernetes ConfigMap) and no service can be pointed at another
run than its neighbours by a forgotten variable. A flag or a config file still sets them per process.

What the run fixes at its creation (recipe, max_staleness, the update budget) is not here: it is
read from the tracker's run (`GET /v1/runs/{run}`), so it has one copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from spopp.settings.base import API_TOKEN_ENV, RUN_ENV, TRACKER_URL_ENV, SettingsGroup
from spopp.settings.fields import ApiToken, RunId

DEFAULT_TRACKER = "http://127.0.0.1:8000"


class RunBinding(SettingsGroup):
    """Run, tracker and token: a base of each run-bound service's settings (fields of its own, so
    every flag and config key keeps its plain name: `--run`, `run:`)."""

    shared_env: ClassVar[Mapping[str, str]] = {
        "run": RUN_ENV,
        "tracker": TRACKER_URL_ENV,
        "api_token": API_TOKEN_ENV,
    }

    # The tracker's own id type: a name it would refuse (a "/", "..") is refused here, at start.
    run: RunId = Field(..., description="the run's name at the tracker")
    tracker: str = Field(DEFAULT_TRACKER, min_length=1, max_length=4096, description="the tracker's base URL")
    api_token: ApiToken | None = Field(
        None,
        description="bearer token of the tracker, also of the learner's intake (prefer the "
        "environment: flags show in process lists)",
    )

    @field_validator("tracker")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http:// or https:// URL with a host, got {value!r}")
        if parts.query or parts.fragment:
            raise ValueError(f"a base URL takes no query or fragment, got {value!r}")
        return value
