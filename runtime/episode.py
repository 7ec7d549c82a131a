"""What one episode is, whoever plays it: its budgets (`Budget`), its record (`Episode`), and the
check every reward passes (`reward_verdict`).

The trajectory is one flat token sequence (runtime/token_sequence.py). Tokens the engine generated
carry mask 1 and the engine's own log-probs; everything else (prompt, observations, tool output,
the template's turn markers) carries mask 0. Budgets: turns, tokens per turn, total tokens; an
episode cut by a budget gets reward 0 and says which budget cut it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from .engines.base import Engine


@dataclass(frozen=True)
class Budget:
    max_turns: int = 8
    max_tokens_per_turn: int = 1024
    max_total_tokens: int = 4096

    def __post_init__(self) -> None:
        if min(self.max_turns, self.max_tokens_per_turn, self.max_total_tokens) < 1:
            raise ValueError(f"every budget must be >= 1, got {self}")


@dataclass
class Episode:
    token_ids: list[int]
    action_mask: list[int]
    rollout_logprobs: list[float]
    reward: float
    num_turns: int
    finish_reason: str
    prompt_tokens: int
    info: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # Per token, the policy version that generated it (None: the engine does not say; tokens
    # the engine did not generate carry the version of the last generation before them).
    token_versions: list[int | None] = field(default_factory=list)
    # Where each segment starts in token_ids: [0] for one sequence; an agent that rewrote its
    # history between calls has more (runtime.agent_session), each trained apart.
    segment_starts: list[int] = field(default_factory=lambda: [0])

    @property
    def generated_tokens(self) -> int:
        return sum(self.action_mask)


def within_context(budget: Budget, engine: Engine) -> Budget:
    """`budget` with max_total_tokens at most the engine's context: an episode that outgrew the
    context would have its next turn refused, so it ends as max_total_tokens with what it has."""
    context = getattr(engine, "context_tokens", None)  # engines of tests may not say
    if context is not None and context < budget.max_total_tokens:
        return replace(budget, max_total_tokens=context)
    return budget


def reward_verdict(value: Any) -> tuple[float, str | None]:
    """(reward, None) for a finite number in [0, 1]; otherwise (0, why): what a user's environment,
    reward function or agent returned is never passed on unchecked (the tracker refuses anything
    else, and the episode would be lost)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0, "not_a_number"
    if not math.isfinite(value):
        return 0.0, "not_finite"
    if not 0.0 <= value <= 1.0:
        return 0.0, "out_of_range"
    return float(value), None
