"""The rollout replica's settings (`spopp rollout serve --help`; env `SPOPP_ROLLOUT_<FIELD>`).

No torch or vLLM import here, so `spopp rollout serve --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from runtime.envs.choice import EnvChoice
from runtime.episode_settings import EpisodeTuning
from services.shell.http_settings import HttpServerSettings
from spopp.settings.base import Settings
from spopp.settings.claim_settings import ClaimSettings
from spopp.settings.fields import WorkerId
from spopp.settings.run_binding import RunBinding


class RolloutTuning(EpisodeTuning, ClaimSettings, HttpServerSettings):
    """What a replica's operator tunes: how episodes are played (EpisodeTuning: engine, concurrency,
    budgets per episode, declared once for every service that plays), draining, sampling, timings,
    its server and claim (also the `rollout:` section of a launch file). RolloutSettings
    adds what binds it to a run: the run, tracker, learner, model, tasks, environment and name (the
    sampling seeds come from the run's seed and study at the tracker: spopp.compare.streams)."""

    task_seed: int = Field(0, ge=0, description="seed of the generated tasks")
    prefetch: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="leases held ready beyond the running episodes, so a freed slot starts at once "
        "instead of waiting for a dispatch; unset: a quarter of concurrency (at least 1)",
    )
    drain: Literal["finish", "abort"] = Field(
        "finish",
        description="on a new policy: let in-flight episodes finish, or release their leases (with "
        "the run's max_staleness k > 0, only episodes more than k versions old are drained)",
    )
    swap: Literal["turn", "episode"] = Field(
        "turn",
        description="with the run's max_staleness k > 0, when new weights come in: between the turns "
        "of running episodes (each token's version is recorded), or once running episodes end",
    )
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="sampling temperature (0: greedy)")
    top_k: int = Field(-1, ge=-1, description="top-k sampling (-1: off)")
    poll_seconds: float = Field(0.2, gt=0, le=60, description="wait between dispatches when no task is idle")
    renew_fraction: float = Field(0.33, gt=0, lt=1, description="renew a lease after this share of it")
    retry_seconds: float = Field(
        300.0,
        ge=0,
        le=86_400,
        description="how long a call to the tracker or the learner is retried through an outage "
        "(connection errors, 502/503/504) before it is given up, logged and counted",
    )
    shutdown_seconds: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="on SIGTERM, how long in-flight episodes may finish and report; then they are "
        "cancelled and their leases released",
    )
    host: str = Field("127.0.0.1", description="address of this replica's /healthz and /metrics")
    port: int = Field(8200, ge=0, le=65535, description="port of /healthz and /metrics")

    def engine_kwargs(self) -> dict:
        """Arguments of `make_engine` for this replica. The transformers engine gets a process of its
        own by default: in the replica's process its decoding thread would share the GIL with the
        event loop (leases, reports, POSTs), which cost a quarter of its tokens/s (BENCHMARKS.md)."""
        lora = {"lora_rank": self.lora_rank} if self.lora_rank else {}
        if self.engine == "transformers":
            return {"process": True, **self.engine_options, **lora}
        return {**self.engine_options, **lora}


class RolloutSettings(RolloutTuning, RunBinding, EnvChoice, Settings):
    env_prefix: ClassVar[str] = "SPOPP_ROLLOUT_"

    model: Path = Field(..., description="model folder of policy version 0 (Hugging Face layout)")
    learner: str = Field("http://127.0.0.1:8100", description="learner base URL (POST /v1/trajectories)")

    tasks: Path | None = Field(None, description="task file (JSONL/parquet: prompt, answer, task_id)")
    generated_tasks: int = Field(
        0, ge=0, le=10_000_000, description="use N generated arithmetic tasks instead of a file"
    )
    worker_id: WorkerId = Field("rollout-0", description="name of this replica")
    max_episodes: int | None = Field(
        None, ge=1, description="stop after N episodes (smoke runs, tests); unset: run until stopped"
    )
