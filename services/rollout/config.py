"""The rollout replica's settings: one typed object, from SPOPP_ROLLOUT_* variables and CLI flags.

No torch or vLLM import here, so `spopp rollout serve --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class RolloutSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPOPP_ROLLOUT_", extra="ignore")

    tracker: str = Field("http://127.0.0.1:8000", description="tracker base URL")
    learner: str = Field("http://127.0.0.1:8100", description="learner base URL (POST /v1/trajectories)")
    run: str = Field("default", description="run name at the tracker")
    model: Path = Field(..., description="model folder for version 0 (Hugging Face layout)")
    engine: Literal["vllm", "transformers"] = Field("vllm", description="generation engine")
    env: Literal["math-tir"] = Field("math-tir", description="environment plug-in")
    tasks: Path | None = Field(None, description="task file (JSONL/parquet: prompt, answer, task_id)")
    generated_tasks: int = Field(0, ge=0, description="use N generated arithmetic tasks instead of a file")
    task_seed: int = Field(0, ge=0, description="seed of generated tasks")
    worker_id: str = Field("rollout-0", min_length=1, max_length=128)
    concurrency: int = Field(8, ge=1, le=1024, description="episodes in flight")
    drain: Literal["finish", "abort"] = Field(
        "finish", description="on a new policy: let in-flight episodes finish, or release their leases"
    )
    max_turns: int = Field(8, ge=1)
    max_tokens_per_turn: int = Field(1024, ge=1)
    max_total_tokens: int = Field(4096, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: int = Field(0, ge=0, description="base of per-episode sampling seeds")
    poll_seconds: float = Field(0.2, gt=0, description="wait between dispatches when no task is idle")
    renew_fraction: float = Field(0.33, gt=0, lt=1, description="renew a lease after this share of it")
    token: str | None = Field(None, description="bearer token for the tracker (SPOPP_API_TOKEN)")
    host: str = Field("127.0.0.1", description="address of this replica's /healthz and /metrics")
    port: int = Field(8200, ge=0, le=65535)
    engine_options: dict = Field(default_factory=dict, description="extra engine arguments")

    @field_validator("token", mode="before")
    @classmethod
    def _empty_is_unset(cls, v):
        return v or None
