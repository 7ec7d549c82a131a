"""Scoring token sequences under the learner's weights, the one pass that the update (old
log-probs before its first step) and SPO's drift (whole sequences after it) both make: micro-batches
planned by the learner's settings, each collated in the update's layout (packed or padded) and run
through the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from services.config.learner import LearnerSettings

from .batch import Batch, collate, plan_micro_batches
from .logprobs import token_logprobs, token_logprobs_entropy


def plan(lengths: Sequence[int], cfg: LearnerSettings, *, mini_batches: int, world: int) -> list:
    """plan[m][rank]: that rank's micro-batches (trajectory indices) in mini-batch m, by `cfg`'s
    micro-batching (count or token budget) and layout."""
    return plan_micro_batches(
        lengths,
        mini_batches,
        world,
        micro_batch_size=cfg.micro_batch_size,
        micro_batch_tokens=cfg.micro_batch_tokens,
        packing=cfg.packing,
    )


def logprobs(model: Any, b: Batch) -> torch.Tensor:
    """b's token log-probs under `model` (b already on the model's device): [rows, T-1]."""
    return token_logprobs(model, b.input_ids, b.attention_mask, position_ids=b.position_ids)


def logprobs_entropy(model: Any, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs and the policy's entropy at every column, from the same forward."""
    return token_logprobs_entropy(model, b.input_ids, b.attention_mask, position_ids=b.position_ids)


class ScoredSequence:
    """A bare token sequence as collate reads a trajectory: every token after the first scored, so
    the batch's loss_mask marks each log-prob wanted, whichever the layout."""

    def __init__(self, tokens: list[int]) -> None:
        self.token_ids = tokens
        self.action_mask = [0] + [1] * (len(tokens) - 1)
        self.rollout_logprobs = [0.0] * len(tokens)


def sequence_logprobs(
    model: Any, device: Any, sequences: list[list[int]], cfg: LearnerSettings
) -> list[list[float]]:
    """Per sequence, log p(token_t | its prefix) for t = 1..T-1 under `model` (on `device`), with
    the update's micro-batching and layout on one rank and one mini-batch (SPO's drift)."""
    if not sequences:
        return []
    out: list[list[float]] = [[] for _ in sequences]
    ((chunks,),) = plan([len(s) for s in sequences], cfg, mini_batches=1, world=1)
    with torch.no_grad():
        for chunk in chunks:
            b = collate([ScoredSequence(sequences[j]) for j in chunk], [0.0] * len(chunk), packed=cfg.packing)
            lp = logprobs(model, b.to(device)).cpu()
            # Sequence j's log-probs, whichever the layout: the scored columns it owns.
            for i, j in enumerate(chunk):
                out[j] = lp[b.loss_mask & (b.owners == i)].tolist()
    return out
