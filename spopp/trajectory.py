"""The trajectory record a rollout replica POSTs to the learner (DESIGN §3), validated on arrival.

One flat token sequence per episode: `action_mask` is 1 exactly on tokens the policy generated
and `rollout_logprobs` holds the engine's log-probs there (0.0 elsewhere), so the learner can
recompute its own log-probs on the same positions and form importance weights.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .tracker_api import Id

MAX_TOKENS = 1 << 20


class Trajectory(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: Id
    request_id: Id
    task_id: Id
    policy_version: int = Field(ge=0)
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=MAX_TOKENS)
    action_mask: list[Annotated[int, Field(ge=0, le=1)]]
    rollout_logprobs: list[Annotated[float, Field(allow_inf_nan=False)]]
    reward: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)
    value: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    advantage: float | None = Field(None, allow_inf_nan=False)
    num_turns: int = Field(ge=0)
    finish_reason: str = Field(max_length=64)
    timings: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _aligned(self) -> Trajectory:
        n = len(self.token_ids)
        if len(self.action_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"token_ids, action_mask and rollout_logprobs must have one length; got "
                f"{n}, {len(self.action_mask)}, {len(self.rollout_logprobs)}"
            )
        if not any(self.action_mask):
            raise ValueError("action_mask has no generated token")
        for i, (m, lp) in enumerate(zip(self.action_mask, self.rollout_logprobs, strict=True)):
            if m and lp > 0.0:
                raise ValueError(f"rollout_logprobs[{i}] = {lp!r} is not a log-probability (> 0)")
        return self

    @property
    def action_tokens(self) -> int:
        return sum(self.action_mask)
