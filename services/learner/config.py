"""The learner's configuration: one typed object, loaded from YAML (`spopp learner run --config`).

No torch or DeepSpeed import here. Defaults follow the paper's appendix table where it speaks
(lr 1e-6, weight decay 0.1, clip [0.2, 0.28], one epoch, IS cap 2, B = 128) and DESIGN.md where
it does not (4 mini-batches per update).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class LearnerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # -- where ---------------------------------------------------------------------------------
    run: str = Field(..., min_length=1, description="run name at the tracker")
    tracker: str = Field("http://127.0.0.1:8000", description="tracker base URL")
    tracker_token: str | None = Field(None, description="bearer token for the tracker")
    model: Path = Field(..., description="initial weights (Hugging Face folder) = policy version 0")
    snapshots: Path = Field(Path("spopp-data/snapshots"), description="shared storage for snapshots/vNNNNNN")
    keep_snapshots: int = Field(3, ge=1, description="snapshots kept on disk (the newest K)")
    checkpoints: Path = Field(Path("spopp-data/checkpoints"), description="training state for --resume")
    checkpoint_every: int = Field(10, ge=1, description="updates between checkpoints")
    log_dir: Path = Field(Path("spopp-data/logs"), description="metrics.jsonl and TensorBoard events")
    host: str = Field("127.0.0.1", description="address of POST /v1/trajectories (rank 0)")
    port: int = Field(8100, ge=0, le=65535)
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="larger trajectory bodies get 413")

    # -- the recipe ----------------------------------------------------------------------------
    recipe: Literal["spopp", "spo"] = Field("spopp", description="must match the tracker run's recipe")
    normalization: Literal["token", "trajectory"] = Field(
        "token", description="advantage standardization measure: token (SPO++) or trajectory (SPO)"
    )
    batch_size: int = Field(
        128, ge=2, description="B: trajectories per update, first completed of the version"
    )
    mini_batches: int = Field(4, ge=1, description="optimizer steps per update (one epoch)")
    micro_batch_size: int = Field(8, ge=1, description="trajectories per forward/backward")
    updates_per_publish: int = Field(1, ge=1, le=16, description="updates per published policy version")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    clip_high: float = Field(0.28, ge=0.0)
    dual_clip: float | None = Field(
        2.0, gt=1.0, description="Dual-Clip c (2 for SPO++, 10 for SPO); null: off"
    )
    is_cap: float = Field(2.0, gt=0.0, description="cap of the rollout importance weight")
    max_updates: int | None = Field(None, ge=1, description="stop after this many updates")

    # -- optimization --------------------------------------------------------------------------
    lr: float = Field(1e-6, gt=0.0)
    weight_decay: float = Field(0.1, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = Field(1.0, gt=0.0, description="max global grad norm; null: no clipping")
    zero_stage: Literal[0, 1, 2, 3] = Field(1, description="DeepSpeed ZeRO stage")
    dtype: Literal["fp32", "bf16"] = "fp32"
    seed: int = Field(0, ge=0)

    # -- evaluation ----------------------------------------------------------------------------
    eval_every: int = Field(0, ge=0, description="updates between evaluations (0: never)")
    eval_tasks: Path | None = Field(None, description="held-out tasks (JSONL/parquet)")

    @model_validator(mode="after")
    def _consistent(self) -> LearnerConfig:
        if self.batch_size % self.mini_batches:
            raise ValueError(f"batch_size {self.batch_size} must split into {self.mini_batches} mini-batches")
        if self.eval_every and self.eval_tasks is None:
            raise ValueError("eval_every needs eval_tasks")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> LearnerConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        return cls.model_validate({**data, **overrides})
