"""One policy update, the PPO step: B trajectories, M optimizer steps, data-parallel over the ranks.

Every rank holds all B trajectories (rank 0 broadcast them). The update is one epoch over M
contiguous mini-batches; within a mini-batch each rank runs its share as micro-batches (by count
or by a token budget: batch.plan_micro_batches). The step sees its engine only through a backend
(backend.py: score a micro-batch, step over a mini-batch's micro-batches given each one's loss, add
up across ranks); how DeepSpeed averages and where its boundaries fall is the backend's concern.

Target gradient per mini-batch: grad of sum over its action tokens of the per-token loss, divided
by N = the action tokens of the WHOLE mini-batch (all ranks). Each micro-batch's loss is its
token-sum / N (policy_loss with token_count=N), so the sum of the micro-batches' losses over
micro-batches and ranks is exactly the target, and that sum is what the backend's step takes.
Gradient clipping then sees the true mini-batch gradient, as in the reference of
tests/learner/test_learner_update.py.

old_logp (the learner's log-probs before this update) is computed for all of this rank's
micro-batches before the first step, under no_grad, on the very same padded micro-batches as
the training pass: the first mini-batch then has ratio exactly 1 and later ones measure only the
effect of the earlier steps, not padding-dependent kernel noise.

That pass also screens the batch (spopp.loss.screen_rows): a trajectory whose loss term is not
finite (its rollout log-probs or advantage in float32, or the learner's own log-probs of it) would
make every gradient of its mini-batch NaN, or stop the update in policy_loss. The ranks agree on
the screen (one all-reduce) and, before any optimizer step, run_update raises
NonFiniteTrajectories naming them; the weights and optimizer are untouched, and the caller drops
them and updates on a batch without them (the trainer: later arrivals take their places). Once a
step is taken, a log-prob that is not finite is the new weights' doing, not a trajectory's (a
diverged update): policy_loss still raises then.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from services.config.learner import LearnerSettings
from spopp.loss import policy_loss, screen_rows, screened

from .batch import Batch, TrajectoryLike, action_tokens, collate, mini_batches
from .scoring import plan as plan_passes

# Token-weighted statistics of policy_loss that are averaged over the whole update.
_MEAN_STATS = ("clip_fraction", "dual_clip_fraction", "approx_kl", "is_weight_mean", "is_capped_fraction")
# The same over stale tokens only (weighted by stale_tokens; 0 in an update without any).
_STALE_STATS = ("behaviour_weight_mean", "behaviour_cut_fraction")


Plan = list[tuple[slice, list[list[int]]]]
# One micro-batch as the training pass sees it: its tensors and its log-probs before the update.
Scored = tuple[Batch, torch.Tensor]
# Called by the backend with (its engine, mini-batch index) on every rank after the mini-batch's
# last backward and before its optimizer step, when the reduced gradients are in place (tests read them).
BeforeStep = Callable[[Any, int], None]


class Backend(Protocol):
    """What the step needs of its training engine (backend.DeepSpeedBackend is the learner's)."""

    device: Any
    rank: int
    world: int

    def accumulation_steps(self) -> int: ...
    def lr(self) -> float: ...
    def training(self) -> AbstractContextManager[None]: ...
    def logprobs(self, b: Batch) -> torch.Tensor: ...
    def logprobs_entropy(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor]: ...
    def step(
        self,
        micro: Sequence[Scored],
        loss_fn: Callable[[Scored], torch.Tensor],
        *,
        before_step: BeforeStep | None = None,
        index: int = 0,
    ) -> float | None: ...
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor: ...


class NonFiniteTrajectories(Exception):
    """Raised by run_update before its first optimizer step: these trajectories' loss terms are
    not finite. `reasons`: {index in the batch: what is not finite}, the same on every rank."""

    def __init__(self, reasons: dict[int, str]) -> None:
        self.reasons = reasons
        listed = "; ".join(f"{i}: {why}" for i, why in sorted(reasons.items()))
        super().__init__(f"{len(reasons)} trajectories with a non-finite loss term ({listed})")


def _plan(trajs: Sequence[TrajectoryLike], cfg: LearnerSettings, rank: int, world: int, gas: int) -> Plan:
    """Per mini-batch: (its slice of the B trajectories, this rank's micro-batches as index lists)."""
    plan = plan_passes([len(t.token_ids) for t in trajs], cfg, mini_batches=cfg.mini_batches, world=world)
    out = []
    for part, per_rank in zip(mini_batches(len(trajs), cfg.mini_batches), plan, strict=True):
        micro = per_rank[rank]
        # By count the engine was built for exactly this many; by tokens the count varies per step
        # and the engine's is only an upper bound (accumulation_steps).
        if cfg.micro_batch_tokens is None and len(micro) != gas:
            raise ValueError(
                f"{len(micro)} micro-batches per rank per mini-batch but the engine accumulates {gas}: "
                "build the engine with the same batch_size, mini_batches and micro-batch settings"
            )
        out.append((part, micro))
    return out


def run_update(
    backend: Backend,
    trajs: Sequence[TrajectoryLike],
    advantages: Sequence[float] | torch.Tensor,
    cfg: LearnerSettings,
    *,
    before_step: BeforeStep | None = None,
    version: int | None = None,
) -> dict[str, float]:
    """Run one update (cfg.mini_batches optimizer steps) on `trajs`; every rank calls it alike.

    `advantages` are the per-trajectory, already normalised advantages, aligned with `trajs`.
    `before_step` is handed to the backend's step.
    Raises NonFiniteTrajectories, before any optimizer step, where some trajectory's loss term is
    not finite (see the module).
    Returns stats identical on every rank: loss (mean over mini-batches of the mini-batch loss),
    clip_fraction, dual_clip_fraction, approx_kl, is_weight_mean, is_capped_fraction (token
    means over the update), is_weight_max, grad_norm (pre-clip, mean over mini-batches), lr,
    tokens, tokens_per_s, update_seconds; entropy (the policy's before the update, nats per action
    token) and padding_fraction (of the tokens the forwards computed); and stale_tokens, behaviour_weight_mean,
    behaviour_cut_fraction, behaviour_weight_max over the tokens that a policy version older than
    `version` (the one being trained; None: none is older) generated.
    """
    started = time.perf_counter()
    adv = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
    if adv.numel() != len(trajs):
        raise ValueError(f"{len(trajs)} trajectories but {adv.numel()} advantages")
    plan = _plan(trajs, cfg, backend.rank, backend.world, backend.accumulation_steps())
    with backend.training():
        tally = _Tally()
        batches = _collate_with_old_logp(backend, trajs, adv, plan, cfg, version, tally)
        grad_norms: list[float] = []
        for m, ((part, _), row) in enumerate(zip(plan, batches, strict=True)):
            # Every rank holds the whole mini-batch, so each computes the same global N locally.
            # A mini-batch without action tokens contributes zero loss; 1 avoids dividing by zero.
            denom = max(action_tokens(trajs[part]), 1)
            norm = backend.step(
                row, _micro_batch_loss(backend, cfg, denom, tally), before_step=before_step, index=m
            )
            if norm is not None:
                grad_norms.append(float(norm))
    return _update_stats(backend, tally, len(plan), grad_norms, started)


def _collate_with_old_logp(
    backend: Backend,
    trajs: Sequence[TrajectoryLike],
    adv: torch.Tensor,
    plan: Plan,
    cfg: LearnerSettings,
    version: int | None,
    tally: _Tally,
) -> list[list[Scored]]:
    """This rank's micro-batches, collated once, each with old_logp: the weights as they are
    before any step, on the very layout (packed or padded) the training pass will see. Raises
    NonFiniteTrajectories (on every rank alike) where the screen finds a trajectory that cannot be
    trained on. `tally` receives the entropy of the policy before the update at the action tokens."""
    batches = []
    # Per trajectory of the batch: screen_rows' code, set by the one rank whose micro-batch holds
    # it (every trajectory is in exactly one), so a sum over the ranks is each one's code.
    codes = torch.zeros(len(trajs), dtype=torch.int64)
    with torch.no_grad():
        for _, micro in plan:
            row = []
            for rows in micro:
                b = collate([trajs[i] for i in rows], adv[rows], version=version, packed=cfg.packing)
                b = b.to(backend.device)
                old, entropy = backend.logprobs_entropy(b)
                codes[rows] = _screen(old, b, cfg, len(rows)).cpu()
                tally.add_forward(b, entropy)
                row.append((b, old))
            batches.append(row)
    codes = backend.all_reduce(codes)
    if bool(codes.any()):
        raise NonFiniteTrajectories({i: screened(int(c)) for i, c in enumerate(codes.tolist()) if c})
    return batches


def _micro_batch_loss(
    backend: Backend, cfg: LearnerSettings, denom: int, tally: _Tally
) -> Callable[[Scored], torch.Tensor]:
    """The loss of one scored micro-batch in a mini-batch of `denom` action tokens: its token-sum
    of the policy loss / denom, under the weights as they are now (tallied as it goes)."""

    def loss_fn(scored: Scored) -> torch.Tensor:
        b, old = scored
        logp = backend.logprobs(b)
        loss, st = policy_loss(
            logp, old, b.advantages, b.loss_mask, token_count=denom, **_loss_options(b, cfg)
        )
        tally.add(loss, st)
        return loss

    return loss_fn


def _loss_options(b: Batch, cfg: LearnerSettings) -> dict[str, Any]:
    """The loss's keyword arguments for micro-batch `b`: one source for the screen and the step, so
    that what is screened is what is trained on."""
    return {
        "rollout_logp": b.rollout_logp,
        "clip_low": cfg.clip_low,
        "clip_high": cfg.clip_high,
        "dual_clip": cfg.dual_clip,
        "is_cap": cfg.is_cap,
        "stale": b.stale,
        "off_policy": cfg.off_policy,
        "behaviour_cap": cfg.behaviour_cap,
    }


def _screen(old: torch.Tensor, b: Batch, cfg: LearnerSettings, n: int) -> torch.Tensor:
    """screen_rows on one micro-batch of `n` trajectories, with the settings the loss will use:
    a code per trajectory, whichever layout holds them."""
    return screen_rows(old, b.advantages, b.loss_mask, owners=b.owners, n_owners=n, **_loss_options(b, cfg))


class _Tally:
    """This rank's sums over the update: loss, tokens, each mean statistic times its tokens, and
    the largest rollout weight; summed (and maximized) over the ranks at the end."""

    def __init__(self) -> None:
        self.sums = torch.zeros(3 + len(_MEAN_STATS) + len(_STALE_STATS), dtype=torch.float64)
        self.w_max = torch.zeros(2, dtype=torch.float64)
        # The old-log-probs pass: entropy summed over action tokens, the forward's tokens (padding
        # included) and the real ones.
        self.forward = torch.zeros(3, dtype=torch.float64)

    def add_forward(self, b: Batch, entropy: torch.Tensor) -> None:
        self.forward[0] += float(entropy.double()[b.loss_mask].sum())
        self.forward[1] += b.forward_tokens
        real = b.attention_mask.sum() if b.attention_mask is not None else b.input_ids.numel()
        self.forward[2] += float(real)

    def add(self, loss: torch.Tensor, st: dict[str, float]) -> None:
        self.sums[0] += float(loss.detach())
        self.sums[1] += st["tokens"]
        self.sums[2] += st["stale_tokens"]
        for k, name in enumerate(_MEAN_STATS):
            self.sums[3 + k] += st[name] * st["tokens"]
        for k, name in enumerate(_STALE_STATS):
            self.sums[3 + len(_MEAN_STATS) + k] += st[name] * st["stale_tokens"]
        self.w_max[0] = max(float(self.w_max[0]), st["is_weight_max"])
        self.w_max[1] = max(float(self.w_max[1]), st["behaviour_weight_max"])

    def reduce(self, backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        return backend.all_reduce(torch.cat([self.sums, self.forward])), backend.all_reduce(self.w_max, "max")


def _update_stats(
    backend: Backend, tally: _Tally, n_mini: int, grad_norms: list[float], started: float
) -> dict[str, float]:
    """Statistics over all ranks: sums add up, the maximum is a maximum."""
    sums, w_max = tally.reduce(backend)
    elapsed = time.perf_counter() - started
    tokens, stale = float(sums[1]), float(sums[2])
    stats = {"loss": float(sums[0]) / n_mini}
    for k, name in enumerate(_MEAN_STATS):
        stats[name] = float(sums[3 + k]) / tokens if tokens else 0.0
    stats["is_weight_max"] = float(w_max[0])
    stats["stale_tokens"] = stale
    for k, name in enumerate(_STALE_STATS):
        stats[name] = float(sums[3 + len(_MEAN_STATS) + k]) / stale if stale else 0.0
    stats["behaviour_weight_max"] = float(w_max[1])
    entropy, forward, real = (float(x) for x in sums[-3:])
    # The policy's entropy at the action tokens before the update (nats per token), and the share
    # of the forward's tokens that were padding (0 when packed).
    stats["entropy"] = entropy / tokens if tokens else 0.0
    stats["padding_fraction"] = 1.0 - real / forward if forward else 0.0
    stats["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else math.nan
    stats["lr"] = backend.lr()
    stats["tokens"] = tokens
    stats["update_seconds"] = elapsed
    stats["tokens_per_s"] = tokens / elapsed if elapsed > 0 else math.nan
    return stats


def staleness_stats(lags: Sequence[int], max_staleness: int) -> dict[str, float]:
    """The batch's staleness: how many versions each trajectory was dispatched before the one
    trained, as a mean, a maximum and a histogram (staleness_0 ... staleness_k: trajectories)."""
    out: dict[str, float] = {
        "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
        "staleness_max": float(max(lags, default=0)),
    }
    for lag in range(max_staleness + 1):
        out[f"staleness_{lag}"] = float(sum(1 for x in lags if x == lag))
    return out


def length_advantage_corr(lengths: Sequence[int], advantages: Sequence[float]) -> float:
    """Pearson correlation of the batch's action-token counts and raw advantages: how strongly a
    response's length co-varies with its advantage, which is where the action-token measure and
    the trajectory measure differ (the paper's eq. 5). 0.0 where either does not vary."""
    n = len(lengths)
    if n < 2:
        return 0.0
    ml, ma = sum(lengths) / n, sum(advantages) / n
    cov = sum((x - ml) * (y - ma) for x, y in zip(lengths, advantages, strict=True))
    vl = sum((x - ml) ** 2 for x in lengths)
    va = sum((y - ma) ** 2 for y in advantages)
    return cov / math.sqrt(vl * va) if vl > 0 and va > 0 else 0.0
