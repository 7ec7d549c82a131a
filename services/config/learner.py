"""The learner's settings (`spopp learner run --help`; env `SPOPP_LEARNER_<FIELD>`; a YAML file).

No torch or DeepSpeed import here. Defaults follow the paper's appendix table where it speaks
(lr 1e-6, weight decay 0.1, clip [0.2, 0.28], one epoch, IS cap 2, B = 128); it does not give the
number of mini-batches per update, for which 4 is our choice (with one, the ratio is 1 and
clipping never acts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from services.shell.http_settings import HttpServerSettings
from spopp.settings.base import Settings
from spopp.settings.fields import MaxStaleness, Recipe, Seed
from spopp.settings.run_binding import RunBinding


class LearnerTuning(HttpServerSettings):
    """What a learner's operator tunes: the update, optimizer, precision, memory, LoRA, its intake
    (also the `learner:` section of a launch file). LearnerSettings adds what binds it to a run:
    the run, tracker, model, folders, seed, and what the run fixed (recipe, k, budget)."""

    # -- intake, snapshots, checkpoints -----------------------------------------------------------
    keep_snapshots: int = Field(
        3, ge=1, le=10_000, description="snapshots kept on disk: the newest K, and any an evaluator holds"
    )
    checkpoint_every: int = Field(
        10,
        ge=1,
        le=1_000_000,
        description="updates between checkpoints besides those of every publish (each published "
        "version is checkpointed before it is announced, so --resume works after a crash anywhere)",
    )
    host: str = Field("127.0.0.1", description="address of POST /v1/trajectories (rank 0)")
    port: int = Field(8100, ge=0, le=65535, description="port of POST /v1/trajectories and /metrics")
    max_body_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, le=1 << 31, description="larger trajectory bodies get 413"
    )

    verify_requests: bool = Field(
        True,
        description="before training on a batch, check with the tracker that each trajectory's "
        "request was issued for this run, for its task and version, and reported; others are "
        "dropped (logged, counted)",
    )

    # -- the update --------------------------------------------------------------------------------
    normalization: Literal["token", "trajectory"] = Field(
        "token",
        description="advantage standardization measure: token (SPO++) or trajectory (SPO); unset: the "
        "recipe's (token for spopp, trajectory for spo)",
    )
    batch_size: int = Field(
        128, ge=2, le=1_000_000, description="B: trajectories per update, first completed of the version"
    )
    mini_batches: int = Field(4, ge=1, le=4096, description="optimizer steps per update (one epoch)")
    micro_batch_size: int = Field(8, ge=1, le=4096, description="trajectories per forward/backward")
    micro_batch_tokens: int | None = Field(
        None,
        ge=16,
        le=1 << 24,
        description="pack micro-batches by padded tokens instead (rows x longest row <= this; the "
        "batch sorted longest first; a longer trajectory goes alone); micro_batch_size is then unused",
    )
    updates_per_publish: int = Field(1, ge=1, le=16, description="updates per published policy version")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO clip below: ratio >= 1 - clip_low")
    clip_high: float = Field(0.28, ge=0.0, le=10.0, description="PPO clip above: ratio <= 1 + clip_high")
    dual_clip: float | None = Field(
        2.0,
        gt=1.0,
        le=1000.0,
        description="Dual-Clip c; unset: the recipe's (2 for SPO++, 10 for SPO); null: off",
    )
    is_cap: float = Field(2.0, gt=0.0, le=1000.0, description="cap of the rollout importance weight")

    # -- staleness (the run's k, max_staleness, allows stale trajectories) -----------------------
    off_policy: Literal["decoupled", "tis"] = Field(
        "decoupled",
        description="correction of tokens an older policy version generated (k > 0): decoupled "
        "(PPO clip around the learner's proximal log-probs, behaviour weight prox/behaviour, tokens "
        "whose weight exceeds behaviour_cap dropped) or tis (the same weight truncated at "
        "behaviour_cap); current-version tokens keep is_cap's truncation either way",
    )
    behaviour_cap: float = Field(
        2.0,
        gt=1.0,
        le=1000.0,
        description="cap of the behaviour weight of tokens from an older policy version: decoupled "
        "drops tokens above it, tis truncates them to it",
    )

    # -- optimization --------------------------------------------------------------------------
    lr: float = Field(1e-6, gt=0.0, le=1.0, description="AdamW learning rate (constant)")
    weight_decay: float = Field(0.1, ge=0.0, le=10.0, description="AdamW weight decay")
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.999), description="AdamW betas, a list of two: [0.9, 0.999]"
    )
    adam_eps: float = Field(1e-8, gt=0.0, le=1.0, description="AdamW's epsilon")
    grad_clip: float | None = Field(
        1.0, gt=0.0, le=1e6, description="max global grad norm; null: no clipping"
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(1, description="DeepSpeed ZeRO stage")
    dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="training dtype (bf16 keeps fp32 master weights)"
    )

    # -- memory --------------------------------------------------------------------------------
    gradient_checkpointing: bool = Field(
        False, description="recompute each layer's activations in backward instead of keeping them"
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "sdpa",
        description="attention kernel; sdpa attends per sequence in a packed row (varlen on CUDA); "
        "flash_attention_2 needs the flash-attn package and a GPU",
    )
    packing: bool = Field(
        True,
        description="pack each micro-batch's trajectories end to end in one row (position ids restart "
        "per sequence; no padding computed); false pads a row per trajectory (the reference path)",
    )
    liger: Literal["auto", "on", "off"] = Field(
        "auto",
        description="liger-kernel's fused RMSNorm, SwiGLU, rotary and linear cross-entropy on CUDA; auto: "
        "where it imports and supports the model's family",
    )
    offload_optimizer: bool = Field(
        False, description="keep the optimizer states (and fp32 master weights) in CPU memory; ZeRO >= 1"
    )
    offload_params: bool = Field(False, description="keep the parameters in CPU memory between uses; ZeRO 3")
    zero3_persistence_threshold: int | None = Field(
        None,
        ge=0,
        le=10**12,
        description="ZeRO 3: parameters of fewer elements stay gathered between uses (DeepSpeed's default "
        "100,000 when unset); above the largest, nothing is gathered and released per forward",
    )

    # -- LoRA ----------------------------------------------------------------------------------
    lora_rank: int = Field(
        0, ge=0, le=1024, description="LoRA rank: train adapters on a frozen base (PEFT); 0: full fine-tuning"
    )
    lora_alpha: float = Field(16.0, gt=0.0, le=1e6, description="LoRA alpha: adapters scale by alpha / rank")
    lora_dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="dropout on the adapters' input (> 0 makes the old and new log-probs differ)",
    )
    lora_target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="the modules that get adapters (names as in the model, e.g. q_proj)",
    )
    lora_publish: Literal["adapter", "merged"] = Field(
        "adapter",
        description="what a LoRA snapshot carries: the adapters alone (replicas keep the base and swap "
        "them in place) or the merged full weights (for replicas that take no adapters)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> LearnerSettings:
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
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage 1, 2 or 3 (ZeRO owns the optimizer states)")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(
                f"offload_params needs zero_stage 3 (parameters are partitioned only there), got {self.zero_stage}"
            )
        return self


class LearnerSettings(LearnerTuning, RunBinding, Settings):
    env_prefix: ClassVar[str] = "SPOPP_LEARNER_"

    # -- where (the run, the tracker and the token: RunBinding) ------------------------------------
    model: Path = Field(..., description="initial weights (Hugging Face folder) = policy version 0")
    snapshots: Path = Field(Path("spopp-data/snapshots"), description="shared storage for snapshots/vNNNNNN")
    checkpoints: Path = Field(Path("spopp-data/checkpoints"), description="training state for --resume")
    log_dir: Path = Field(Path("spopp-data/logs"), description="metrics.jsonl and TensorBoard events")

    # -- what the run fixed at its creation (binding.py reads it from the tracker) ----------------
    recipe: Recipe | None = Field(
        None, description="unset: the tracker run's (fixed at its creation); set: must be the run's"
    )
    max_updates: int | None = Field(
        None,
        ge=1,
        description="stop after this many updates; unset: the tracker run's budget (never, for a run "
        "without one); set: must be the run's budget where it has one",
    )
    max_staleness: MaxStaleness | None = Field(
        None,
        description="k: train on trajectories dispatched up to k policy versions before the one being "
        "trained (0: the current version's only, the paper's protocol); unset: the tracker run's; "
        "set: must be the run's",
    )
    seed: Seed = Field(0, description="seed of torch's RNG on every rank")
