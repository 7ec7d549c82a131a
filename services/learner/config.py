"""The learner's configuration: one typed object, loaded from YAML (`spopp learner run --config`).

No torch or DeepSpeed import here. Defaults follow the paper's appendix table where it speaks
(lr 1e-6, weight decay 0.1, clip [0.2, 0.28], one epoch, IS cap 2, B = 128) and DESIGN.md where
it does not (4 mini-batches per update).
"""

from __future__ import annotations

import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class EvalConfig(BaseModel):
    """Scoring held-out tasks with the policy just published, greedy and sampled.

    The episodes run the rollout's own agent loop and environment on rank 0, on an engine that
    loads each snapshot in turn, one evaluation at a time while training goes on. When evaluation
    is slower than `every` updates, a new snapshot takes the place of one still waiting for its
    turn (that one is logged as skipped). Sampled episodes use fixed seeds per (task, sample), the same at
    every evaluation, so consecutive points differ by the weights rather than by sampling noise.
    """

    model_config = ConfigDict(extra="forbid")

    every: int = Field(..., ge=1, description="updates between evaluations")
    tasks: Path = Field(..., description="held-out tasks (JSONL/parquet: prompt, answer, task_id)")
    max_tasks: int | None = Field(None, ge=1, description="score only the first N tasks of the file")
    at_start: bool = Field(True, description="also score the initial policy (version 0) before update 1")
    env: Literal["math-tir"] = "math-tir"
    engine: Literal["transformers", "vllm"] = Field("transformers", description="generation engine")
    engine_options: dict = Field(default_factory=dict, description="extra engine arguments")
    greedy: bool = Field(True, description="one temperature-0 episode per task")
    samples: int = Field(4, ge=0, description="sampled episodes per task (avg@k, pass@k); 0: none")
    temperature: float = Field(1.0, gt=0.0, description="temperature of the sampled episodes")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_turns: int = Field(8, ge=1)
    max_tokens_per_turn: int = Field(1024, ge=1)
    max_total_tokens: int = Field(4096, ge=1)
    concurrency: int = Field(32, ge=1, description="episodes in flight")
    seed: int = Field(0, ge=0, description="base of the sampled episodes' seeds")
    final_wait_s: float = Field(
        3600.0, gt=0, description="at the end of training, how long to wait for evaluations still running"
    )

    @model_validator(mode="after")
    def _something(self) -> EvalConfig:
        if not self.greedy and self.samples == 0:
            raise ValueError("eval needs greedy: true or samples >= 1")
        return self


class LearnerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # -- where ---------------------------------------------------------------------------------
    run: str = Field(..., min_length=1, description="run name at the tracker")
    tracker: str = Field("http://127.0.0.1:8000", description="tracker base URL")
    tracker_token: str | None = Field(
        None, description="bearer token for the tracker (default: $SPOPP_API_TOKEN)"
    )
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
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW's epsilon")
    grad_clip: float | None = Field(1.0, gt=0.0, description="max global grad norm; null: no clipping")
    zero_stage: Literal[0, 1, 2, 3] = Field(1, description="DeepSpeed ZeRO stage")
    dtype: Literal["fp32", "bf16"] = "fp32"
    seed: int = Field(0, ge=0)

    # -- evaluation ----------------------------------------------------------------------------
    eval: EvalConfig | None = Field(None, description="held-out evaluation; null: none")

    @model_validator(mode="after")
    def _consistent(self) -> LearnerConfig:
        if self.batch_size % self.mini_batches:
            raise ValueError(f"batch_size {self.batch_size} must split into {self.mini_batches} mini-batches")
        if self.zero_stage == 0 and self.dtype == "bf16":
            # DeepSpeed 0.19.8 wraps the optimizer in FP16_UnfusedOptimizer there, whose constructor
            # steps AdamW once on zero gradients: weight decay hits the master copy before training
            # and every bias correction runs one step late (the first update ~0.73 of its size).
            raise ValueError(
                "zero_stage 0 with dtype bf16 is refused: DeepSpeed's ZeRO-0 bf16 optimizer takes "
                "one AdamW step on zero gradients at start-up, so every update is off; use "
                "zero_stage 1 (same memory for the weights, optimizer state partitioned)"
            )
        if self.eval is not None and self.eval.every % self.updates_per_publish:
            # Evaluation scores a published snapshot, so it can only fall on a publish.
            raise ValueError(
                f"eval.every ({self.eval.every}) must be a multiple of updates_per_publish "
                f"({self.updates_per_publish})"
            )
        return self

    @classmethod
    def from_yaml(cls, path: str | Path, sets: Iterable[str] = (), **overrides) -> LearnerConfig:
        """The YAML file, then each `KEY=VALUE` of `sets` (dotted keys reach nested settings:
        `eval.every=5`; values are read as YAML: `null`, `2`, `1e-6`, `[0.9, 0.95]`), then
        `overrides`."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        for item in sets:
            apply_setting(data, item)
        return cls.model_validate({**data, **overrides})


def apply_setting(data: dict, item: str) -> None:
    """Apply one `KEY=VALUE` (dotted KEY) to a settings mapping in place."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set expects KEY=VALUE (e.g. tracker=http://tracker:8000), got {item!r}")
    *parents, leaf = key.strip().split(".")
    node = data
    for name in parents:
        child = node.get(name)
        if child is None:  # absent, or `eval:` / `eval: null` in the file
            child = node[name] = {}
        if not isinstance(child, dict):
            raise ValueError(f"--set {item!r}: {name!r} is not a group of settings")
        node = child
    if not raw.strip():
        node[leaf] = None
    elif _is_text(LearnerConfig, [*parents, leaf]):
        node[leaf] = raw  # a run named 123 or a token 0x1F stays the text it is
    else:
        node[leaf] = yaml.safe_load(raw)


def _is_text(model: type[BaseModel], path: list[str]) -> bool:
    """Whether the setting at `path` takes text (str or a path) and no number, list or mapping."""

    def kinds(name: str) -> set:
        field = model.model_fields.get(name)  # unknown names: the validation will say so
        return (
            set(typing.get_args(field.annotation) or (field.annotation,)) - {type(None)} if field else set()
        )

    for name in path[:-1]:  # down through nested groups (`eval: EvalConfig | None`)
        model = next((k for k in kinds(name) if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if model is None:
            return False
    leaf = kinds(path[-1])
    return bool(leaf) and leaf <= {str, Path}
