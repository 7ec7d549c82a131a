"""The tracker's settings: one typed object, read from SPOPP_* environment variables and CLI flags."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class TrackerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPOPP_", extra="ignore")

    redis_url: str | None = Field(
        None, description="Redis to keep all state in; none starts an embedded redis-server"
    )
    data_dir: Path = Field(Path("spopp-data/tracker"), description="embedded Redis's AOF folder")
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind (0: any free port)")
    api_token: str | None = Field(
        None, min_length=16, description="bearer token every /v1 route requires, when set"
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="larger request bodies are refused with 413"
    )
    redis_wait_seconds: float = Field(30.0, gt=0, description="how long start-up waits for Redis")
    log_level: str = Field("info", description="uvicorn log level")

    @field_validator("api_token", "redis_url", mode="before")
    @classmethod
    def _empty_is_unset(cls, v):
        # compose passes `${SPOPP_API_TOKEN:-}` through as an empty string when it is not set.
        return v or None
