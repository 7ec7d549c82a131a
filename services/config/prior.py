"""`spopp prior`'s settings (`spopp prior --help`; env `SPOPP_PRIOR_<FIELD>`; a YAML file).

The offline prompt-value initialization of SPO++'s protocol: `rollouts` sampled episodes per
training task with the cold-start policy, then a Jeffreys prior of mass `prior_mass` per task,
written to `out` for every run of a comparison to load. Episodes are played like the evaluator's
(same agent loop, environment, engines and per-(task, sample) seeds), so the episode settings
are `EvaluatorSettings`' own (`EpisodeSettings`). No torch or vLLM import here, so `--help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from services.config.evaluator import EpisodeSettings
from spopp.api.tracker_api import MIN_PRIOR, Prior


class PriorSettings(EpisodeSettings):
    env_prefix: ClassVar[str] = "SPOPP_PRIOR_"

    # -- what to play, and where the prior goes -------------------------------------------------
    model: Path = Field(..., description="model folder of the cold-start (base) policy, the runs' version 0")
    tasks: Path = Field(
        ...,
        description="the TRAINING task file (JSONL/parquet: prompt, answer, task_id), the one the "
        "rollout replicas serve",
    )
    out: Path = Field(..., description="the prior file to write (JSON, spopp-prior/1)")
    overwrite: bool = Field(
        False,
        description="replace an existing `out` (refused by default: every run of a comparison must "
        "share one prior)",
    )
    rollouts: int = Field(8, ge=1, le=1024, description="sampled episodes per task")
    prior_mass: Prior = Field(8.0, description="total Beta mass alpha0 + beta0 of each task")
    max_tasks: int | None = Field(None, ge=1, le=10_000_000, description="only the first N tasks of the file")

    # -- episodes --------------------------------------------------------------------------------
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="sampling temperature (the rollouts')")
    seed: int = Field(
        0, ge=0, lt=2**62, description="base of the episodes' seeds (fixed per task and rollout)"
    )

    @model_validator(mode="after")
    def _tracker_takes_the_prior(self) -> PriorSettings:
        # The smallest alpha0 or beta0 is m * 0.5 / (n + 1) (a task solved 0 or n times); below the
        # tracker's floor the launch would refuse the file after every episode had been played.
        smallest = self.prior_mass * 0.5 / (self.rollouts + 1)
        if smallest < MIN_PRIOR:
            raise ValueError(
                f"prior_mass {self.prior_mass} with {self.rollouts} rollouts gives alpha0/beta0 as small "
                f"as {smallest:.3g}, below the tracker's {MIN_PRIOR}: raise prior_mass"
            )
        return self
