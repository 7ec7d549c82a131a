"""`spopp init`'s settings: the run to create at the tracker, its tasks, prior and budget."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from spopp.settings.base import Settings
from spopp.settings.fields import Recipe, Seed
from spopp.settings.run_binding import RunBinding


class InitSettings(RunBinding, Settings):
    env_prefix: ClassVar[str] = "SPOPP_INIT_"

    recipe: Recipe = Field(..., description="spopp (SPO++) or spo")
    seed: Seed = Field(0, description="seed of the tracker's sampler")
    base_snapshot: str = Field(
        ..., min_length=1, description="policy version 0 as the replicas see it (a model folder path)"
    )
    tasks: Path = Field(..., description="training tasks (JSONL/parquet), the replicas' task file")
    prior: Path | None = Field(
        None, description="task prior from `spopp prior`; unset: a flat Jeffreys prior for every task"
    )
    max_updates: int | None = Field(
        None, ge=1, description="the run's budget in learner updates, fixed at its creation: the learner's "
        "max_updates (an existing run with another is refused; unset: not fixed)",
    )  # fmt: skip
    run_config: dict = Field(
        default_factory=dict,
        description="the run's other fields: retention, prior_mass, lease_seconds, d_half, rho_min, rho_max",
    )
    wait_seconds: float = Field(300.0, gt=0, le=86_400, description="how long to wait for the tracker")
