"""From trajectories to training tensors, and how one update's batch splits across steps and ranks.

Collation: right-padded sequences for next-token prediction. Position t of every [n, T-1] tensor
refers to the prediction of token t+1 from the prefix up to t, so `loss_mask` is the action mask
shifted left by one: a generated token is trained on at the position that predicts it. A token at
position 0 has no prefix and can never be trained on; `action_tokens` counts what the loss sees.
Right padding keeps every real token at its natural position (0, 1, ...), which is what a causal
model computes without explicit position ids, and no real token attends to padding.

Splitting: an update's B trajectories form M contiguous mini-batches in receipt order (one
optimizer step each). Every rank holds all B; each takes an equal contiguous share of a mini-batch
and splits it into micro-batches for forward/backward. Equal shares are required, not just
convenient: DeepSpeed counts micro-steps per rank to find the accumulation boundary, so every rank
must run the same number of micro-batches per step or the ranks' collectives would pair up wrongly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from spopp.trajectory import count_action_tokens


class TrajectoryLike(Protocol):
    """What collation reads of a trajectory (spopp.trajectory.Trajectory has it)."""

    token_ids: Sequence[int]
    action_mask: Sequence[int]
    rollout_logprobs: Sequence[float]


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors of n trajectories, T = the longest of them."""

    input_ids: Tensor  # [n, T] int64, padding = pad_id
    attention_mask: Tensor  # [n, T] int64, 1 on real tokens
    loss_mask: Tensor  # [n, T-1] bool: action_mask[:, 1:], False on padding
    rollout_logp: Tensor  # [n, T-1] float32: rollout engine's log-probs of token t+1, 0 elsewhere
    advantages: Tensor  # [n, T-1] float32: the trajectory's advantage on every position

    @property
    def tokens(self) -> int:
        """Action tokens the loss sees in this batch."""
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> Batch:
        fields = (self.input_ids, self.attention_mask, self.loss_mask, self.rollout_logp, self.advantages)
        return Batch(*(t.to(device) for t in fields))


def trainable_tokens(traj: TrajectoryLike) -> int:
    """Action tokens of one trajectory, as normalisation counts them (one definition for both)."""
    return count_action_tokens(traj.action_mask)


def action_tokens(trajs: Sequence[TrajectoryLike]) -> int:
    """Action tokens the loss sees over `trajs`: the token_count of a mini-batch."""
    return sum(trainable_tokens(t) for t in trajs)


def collate(
    trajs: Sequence[TrajectoryLike], advantages: Sequence[float] | Tensor, *, pad_id: int = 0
) -> Batch:
    """Pad `trajs` on the right into a Batch; `advantages[i]` is broadcast over trajectory i."""
    adv = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
    if len(trajs) == 0:
        raise ValueError("cannot collate an empty list of trajectories")
    if adv.numel() != len(trajs):
        raise ValueError(f"{len(trajs)} trajectories but {adv.numel()} advantages")
    n, width = len(trajs), max(len(t.token_ids) for t in trajs)
    if width < 2:
        raise ValueError("every batch needs a sequence of at least 2 tokens to predict anything")
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    action = torch.zeros((n, width), dtype=torch.bool)
    rollout = torch.zeros((n, width), dtype=torch.float32)
    for i, t in enumerate(trajs):
        k = len(t.token_ids)
        if len(t.action_mask) != k or len(t.rollout_logprobs) != k:
            raise ValueError(f"trajectory {i}: token_ids, action_mask and rollout_logprobs differ in length")
        input_ids[i, :k] = torch.as_tensor(t.token_ids, dtype=torch.long)
        attention_mask[i, :k] = 1
        action[i, :k] = torch.as_tensor(t.action_mask, dtype=torch.long) != 0
        rollout[i, :k] = torch.as_tensor(t.rollout_logprobs, dtype=torch.float32)
    # Shift by one: column t holds what the prediction made at position t is scored on (token t+1).
    loss_mask = action[:, 1:]
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        rollout_logp=torch.where(loss_mask, rollout[:, 1:], torch.zeros_like(rollout[:, 1:])),
        advantages=adv[:, None].expand(n, width - 1).clone(),
    )


def mini_batches(n: int, m: int) -> list[slice]:
    """The m contiguous, equal mini-batches of n trajectories, in order."""
    if m < 1 or n < 1:
        raise ValueError(f"need n >= 1 and m >= 1, got n={n}, m={m}")
    if n % m:
        raise ValueError(f"{n} trajectories do not split into {m} equal mini-batches")
    k = n // m
    return [slice(i * k, (i + 1) * k) for i in range(m)]


def rank_share(part: slice, rank: int, world_size: int) -> slice:
    """Rank `rank`'s contiguous share of `part` (a slice with explicit start and stop)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    n = part.stop - part.start
    if n % world_size:
        raise ValueError(
            f"a mini-batch of {n} trajectories does not split evenly over {world_size} ranks; "
            "choose batch_size divisible by mini_batches * world_size"
        )
    k = n // world_size
    return slice(part.start + rank * k, part.start + (rank + 1) * k)


def micro_batches(part: slice, size: int) -> list[slice]:
    """`part` in consecutive chunks of `size` trajectories; the last one may be shorter.

    A shorter last chunk is harmless because the loss is normalised by the mini-batch's token
    count, not by the number or size of micro-batches.
    """
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    return [slice(s, min(s + size, part.stop)) for s in range(part.start, part.stop, size)]


def accumulation_steps(batch_size: int, n_mini: int, world_size: int, micro_batch_size: int) -> int:
    """Micro-batches each rank runs per mini-batch: DeepSpeed's gradient_accumulation_steps.

    Raises ValueError with the offending numbers when the batch does not split evenly.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    per_mini = mini_batches(batch_size, n_mini)[0]
    share = rank_share(per_mini, 0, world_size)
    return math.ceil((share.stop - share.start) / micro_batch_size)
