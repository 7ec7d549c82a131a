"""The tracker's settings (`spopp tracker serve --help` lists them; env `SPOPP_TRACKER_<FIELD>`)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from services.shell.http_settings import HttpServerSettings
from spopp.api.tracker_api import MAX_RUNS, MAX_WORKERS_PER_RUN
from spopp.settings.base import Settings
from spopp.settings.fields import ApiToken


class TrackerTuning(HttpServerSettings):
    """What a tracker's operator tunes: Redis, address, bounds and timings (also the `tracker:`
    section of a launch file). TrackerSettings adds what the run's wiring sets."""

    redis_url: str | None = Field(
        None, description="Redis that keeps all state (redis://host:port/db); unset: an embedded redis-server"
    )
    redis_password_file: Path | None = Field(
        None,
        description="a file holding the Redis password (compose: the secrets volume's); read at start, "
        "never given on the command line, where process lists show it. The embedded Redis makes its own "
        "(redis.password under data_dir, 0600)",
    )
    redis_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="embedded Redis only: its port on 127.0.0.1 (0: a free one, drawn again if another "
        "process takes it before redis binds it)",
    )
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind (0: any free port)")
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, le=1 << 30, description="larger request bodies are refused with 413"
    )
    redis_wait_seconds: float = Field(30.0, gt=0, le=3600, description="how long start-up waits for Redis")
    instance_file: Path | None = Field(
        None,
        description="where this process writes its instance id once Redis answers; /healthz and /readyz "
        "report the same id, so a health check that reads the file tells this tracker from another "
        "program answering on the port (compose: /tmp/spopp-tracker-instance)",
    )
    redis_timeout_seconds: float = Field(
        10.0,
        ge=0.1,
        le=600,
        description="how long one Redis command may take; past it the call answers 503 (the client retries)",
    )
    redis_down_seconds: float = Field(
        60.0,
        ge=1,
        le=86400,
        description="/healthz answers 503 once Redis has not answered for this long, so that an "
        "orchestrator restarts the tracker (/readyz answers 503 as soon as Redis does not answer)",
    )
    redis_max_restarts: int = Field(
        5,
        ge=0,
        le=1000,
        description="embedded Redis only: restarts allowed within redis_restart_window_seconds; one "
        "more death and the tracker gives up, /healthz answers 503",
    )
    redis_restart_window_seconds: float = Field(
        300.0, ge=1, le=86400, description="embedded Redis only: the window that redis_max_restarts counts in"
    )
    idempotency_ttl_seconds: float = Field(
        3600.0,
        ge=1,
        le=30 * 86400,
        description="how long finished calls are remembered: dispatch idempotency keys, consume update "
        "ids, and finished requests (a repeated report answers the same, a late one 409; after it, 404). "
        "Keep it above the clients' retry bound (5 minutes by default)",
    )
    max_workers_per_run: int = Field(
        MAX_WORKERS_PER_RUN,
        ge=1,
        le=1_000_000,
        description="workers a run keeps stats of (GET /v1/runs/{run} `workers`, /metrics); a new "
        "worker beyond it is refused with 409 too_many_workers, so no caller grows Redis without bound",
    )
    max_runs: int = Field(
        MAX_RUNS,
        ge=1,
        le=1_000_000,
        description="runs this tracker keeps; a new run beyond it is refused with 409 too_many_runs "
        "(existing runs answer as before), so that no caller grows Redis or a /metrics scrape without bound",
    )
    metrics_auth: Literal["auto", "on", "off"] = Field(
        "auto",
        description="whether /metrics needs the api_token too (it names runs and workers): auto is on "
        "when the tracker binds beyond loopback (host other than 127.0.0.1, ::1, localhost) and a token is set",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "info",
        description="uvicorn's log level (its start, stop and error lines); request lines are "
        "http_access_log_per_minute's, off by default",
    )


class TrackerSettings(TrackerTuning, Settings):
    env_prefix: ClassVar[str] = "SPOPP_TRACKER_"
    data_dir: Path = Field(Path("spopp-data/tracker"), description="the embedded Redis's AOF folder")
    api_token: ApiToken | None = Field(
        None,
        description="bearer token every /v1 route requires, when set (prefer the environment: "
        "flags show in process lists)",
    )


LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def metrics_need_token(settings: TrackerSettings) -> bool:
    """Whether /metrics asks for the bearer token (never without one to ask for)."""
    if settings.api_token is None or settings.metrics_auth == "off":
        return False
    return settings.metrics_auth == "on" or settings.host not in LOOPBACK


def password_from_file(settings: TrackerSettings) -> str | None:
    """The password in redis_password_file (its first line, stripped); None without one. A missing
    or empty file is an error that names it, not a silent unauthenticated connection."""
    if settings.redis_password_file is None:
        return None
    path = settings.redis_password_file
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"redis_password_file {path}: {exc.strerror or exc}") from exc
    if not text:
        raise ValueError(f"redis_password_file {path} is empty")
    return text.splitlines()[0]
