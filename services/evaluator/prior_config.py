"""`spopp prior`'s settings (`spopp prior --help`; env `SPOPP_PRIOR_<FIELD>`; a YAML file).

The offline prompt-value initialization of SPO++'s protocol: `rollouts` sampled episodes per
training task with the cold-start policy, then a Jeffreys prior of mass `prior_mass` per task,
written to `out` for every run of a comparison to load. Episodes are played like the evaluator's
(same agent loop, environment, engines and per-(task, sample) seeds), so the episode settings
mirror `EvaluatorSettings`. No torch or vLLM import here, so `--help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from spopp.settings import Settings
from spopp.tracker_api import MAX_PRIOR, MIN_PRIOR


class PriorSettings(Settings):
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
    prior_mass: float = Field(
        8.0,
        ge=MIN_PRIOR,
        le=MAX_PRIOR,
        allow_inf_nan=False,
        description="total Beta mass alpha0 + beta0 of each task",
    )
    max_tasks: int | None = Field(None, ge=1, le=10_000_000, description="only the first N tasks of the file")

    # -- episodes --------------------------------------------------------------------------------
    env: Literal["math-tir", "toy-calc"] = Field("math-tir", description="environment plug-in")
    engine: Literal["transformers", "vllm"] = Field(
        "transformers", description="generation engine (transformers: CPU unless engine_options.device)"
    )
    engine_options: dict = Field(
        default_factory=dict,
        description="extra engine arguments, a mapping: {device: cuda:1} (transformers), "
        "{gpu_memory_utilization: 0.8} (vllm)",
    )
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="sampling temperature (the rollouts')")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    max_turns: int = Field(8, ge=1, le=1000, description="model turns per episode")
    max_tokens_per_turn: int = Field(1024, ge=1, le=1_000_000, description="tokens per model turn")
    max_total_tokens: int = Field(
        4096, ge=1, le=10_000_000, description="tokens per episode, prompt included"
    )
    concurrency: int = Field(32, ge=1, le=4096, description="episodes in flight on the engine")
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
