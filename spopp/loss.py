"""Clipped policy-gradient loss: asymmetric PPO clip, Dual-Clip, truncated rollout correction.

Per generated action token with ratio r = exp(logp - old_logp) and advantage A:

    L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))     (asymmetric PPO clip)
    L = min(L, -dual_clip * A)            if A < 0               (Dual-Clip)
    w = min(exp(old_logp - rollout_logp), is_cap)                (rollout correction, detached)
    loss = sum(w * L * mask) / token_count

Only logp carries gradient. old_logp and rollout_logp come from other engines (the learner's
pre-update pass and the rollout engine), so their difference measures engine mismatch, not
something to optimise; the advantages are data. token_count is the token count of the whole
mini-batch, not of this call, so that gradients of micro-batches add up to the mini-batch gradient.

Padding positions (mask == 0) may hold anything, including inf or NaN: they are replaced by zeros
before any arithmetic, because a NaN multiplied by a zero mask would still be NaN in the forward
pass and in the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def _check_hparams(clip_low: float, clip_high: float, dual_clip: float | None, is_cap: float) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must lie in [0, 1), got {clip_low!r}")
    if not (math.isfinite(clip_high) and clip_high >= 0.0):
        raise ValueError(f"clip_high must be finite and >= 0, got {clip_high!r}")
    if dual_clip is not None and not (math.isfinite(dual_clip) and dual_clip > 1.0):
        raise ValueError(f"dual_clip must be None or a finite number > 1, got {dual_clip!r}")
    if math.isnan(is_cap) or is_cap <= 0.0:
        raise ValueError(f"is_cap must be > 0, got {is_cap!r}")


def _check_tensors(tensors: dict[str, Tensor | None]) -> None:
    shape = tensors["logp"].shape
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logp")
        if name != "mask" and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got dtype {t.dtype}")


def _bool_mask(mask: Tensor) -> Tensor:
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must hold only 0 and 1")
    return mask != 0


def _masked_finite(name: str, t: Tensor, keep: Tensor) -> Tensor:
    """t with padding replaced by zeros; raises if a counted token is not finite."""
    if not bool(torch.isfinite(t[keep]).all()):
        raise ValueError(f"{name} has NaN or infinite values at tokens where mask == 1")
    return torch.where(keep, t, torch.zeros_like(t))


def _token_count(token_count: float | Tensor | None, keep: Tensor) -> float:
    n = float(keep.sum()) if token_count is None else float(token_count)
    if not (math.isfinite(n) and n > 0):
        what = "mask.sum()" if token_count is None else "token_count"
        raise ValueError(f"token count must be finite and > 0, got {what} = {n!r}")
    return n


def _masked_mean(x: Tensor, keep: Tensor, tokens: int) -> float:
    # An empty micro-batch reports 0.0: callers weight stats by `tokens`, and NaN would poison that.
    return float(x[keep].sum()) / tokens if tokens else 0.0


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    rollout_logp: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 2.0,
    is_cap: float = 2.0,
    token_count: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Token-sum clipped surrogate divided by token_count; returns (loss, stats).

    logp, old_logp, advantages, mask (and rollout_logp when given) share one shape, usually
    [B, T]; advantages are already broadcast per token; mask is bool or 0/1 and is 1 on generated
    action tokens only. rollout_logp=None means no rollout correction (w = 1). dual_clip=None
    disables Dual-Clip. token_count defaults to mask.sum(); pass the mini-batch total to every
    micro-batch. A micro-batch with no counted token returns a zero loss still attached to logp.

    stats (python floats over this call's counted tokens, 0.0 where there are none):
      clip_fraction: share of tokens where a clip binds: the clipped PPO term is strictly larger
        than the unclipped one, or Dual-Clip binds;
      dual_clip_fraction: share of tokens with A < 0 whose PPO term exceeded -dual_clip * A;
      approx_kl: k3 estimate of KL(old || new), mean of (exp(old - logp) - 1) - (old - logp);
      is_weight_mean, is_weight_max: the applied rollout weights w;
      is_capped_fraction: share of tokens whose raw weight exp(old - rollout) reached is_cap;
      tokens: number of counted tokens in this call.

    Raises ValueError on mismatched shapes, non-floating inputs, a mask that is not 0/1,
    non-finite values at counted tokens, token_count <= 0 (or an all-zero mask without an
    explicit token_count), or out-of-range hyperparameters.
    """
    _check_hparams(clip_low, clip_high, dual_clip, is_cap)
    _check_tensors(
        {
            "logp": logp,
            "old_logp": old_logp,
            "advantages": advantages,
            "mask": mask,
            "rollout_logp": rollout_logp,
        }
    )
    keep = _bool_mask(mask)
    denom = _token_count(token_count, keep)
    new = _masked_finite("logp", logp, keep)
    old = _masked_finite("old_logp", old_logp.detach(), keep)
    adv = _masked_finite("advantages", advantages.detach(), keep)

    surrogate = _surrogate(new, old, adv, clip_low, clip_high, dual_clip)
    raw_w, weight = _rollout_weight(old, rollout_logp, keep, is_cap)
    loss = (weight * surrogate.per_token * keep.to(surrogate.per_token.dtype)).sum() / denom
    with torch.no_grad():
        stats = _stats(surrogate, new, old, raw_w, weight, keep, is_cap, rollout_logp is not None)
    return loss, stats


@dataclass(frozen=True)
class _Surrogate:
    """The per-token clipped objective and what the statistics need of its parts."""

    per_token: Tensor  # max(-A r, -A clip(r)), then Dual-Clip's cap where A < 0
    unclipped: Tensor  # -A r
    clipped: Tensor  # -A clip(r, 1 - clip_low, 1 + clip_high)
    dual_active: Tensor  # bool: Dual-Clip's cap binds


def _surrogate(
    new: Tensor, old: Tensor, adv: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> _Surrogate:
    ratio = torch.exp(new - old)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(new, dtype=torch.bool)
    if dual_clip is not None:
        cap = -dual_clip * adv
        dual_active = (adv < 0) & (per_token > cap)
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
    return _Surrogate(per_token, unclipped, clipped, dual_active)


def _rollout_weight(
    old: Tensor, rollout_logp: Tensor | None, keep: Tensor, is_cap: float
) -> tuple[Tensor, Tensor]:
    """(raw, applied) rollout-correction weights; ones without rollout_logp."""
    if rollout_logp is None:
        raw_w = torch.ones_like(old)
        return raw_w, raw_w
    rollout = _masked_finite("rollout_logp", rollout_logp.detach(), keep)
    raw_w = torch.exp(old - rollout)
    return raw_w, torch.clamp(raw_w, max=is_cap)


def _stats(
    s: _Surrogate,
    new: Tensor,
    old: Tensor,
    raw_w: Tensor,
    weight: Tensor,
    keep: Tensor,
    is_cap: float,
    corrected: bool,
) -> dict[str, float]:
    """The loss's statistics over the counted tokens (see policy_loss); call under no_grad."""
    tokens = int(keep.sum())
    clip_active = (s.clipped > s.unclipped) | s.dual_active
    log_back = old - new.detach()
    k3 = torch.expm1(log_back) - log_back
    capped = (raw_w >= is_cap) if corrected else torch.zeros_like(keep)
    return {
        "clip_fraction": _masked_mean(clip_active.double(), keep, tokens),
        "dual_clip_fraction": _masked_mean(s.dual_active.double(), keep, tokens),
        "approx_kl": _masked_mean(k3, keep, tokens),
        "is_weight_mean": _masked_mean(weight, keep, tokens),
        "is_weight_max": float(weight[keep].max()) if tokens else 0.0,
        "is_capped_fraction": _masked_mean(capped.double(), keep, tokens),
        "tokens": float(tokens),
    }
