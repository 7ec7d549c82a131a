"""Advantage whitening over a batch of trajectories: per trajectory (paper eq. 4) or per token (eq. 6).

A token-mean policy loss weighs trajectory i by its number of generated action tokens L_i. Whitening
per trajectory (eq. 4) centres the advantages under the uniform measure over trajectories, so the
loss still sees the residual sum_i L_i A~_i / sum_i L_i = Cov_n(L, A~) / mean(L) (eq. 5), a bias
towards long or short answers whenever length and advantage co-vary. Whitening per token (eq. 6)
centres and scales under the measure the loss uses, so that residual is zero by construction.

Statistics are taken in float64 because sums of L_i (A_i - mu)^2 over long batches lose the
small-variance case in float32; the result is cast back to the caller's floating dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

Measure = Literal["token", "trajectory"]
MEASURES: tuple[str, ...] = ("token", "trajectory")


def _out_dtype(adv: Tensor) -> torch.dtype:
    return adv.dtype if adv.is_floating_point() else torch.float32


def _as_vector(name: str, x: Tensor | Sequence[float]) -> Tensor:
    t = torch.as_tensor(x)
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name} must be real numbers, got dtype {t.dtype}")
    if t.ndim != 1:
        raise ValueError(f"{name} must be a 1-D batch [n], got shape {tuple(t.shape)}")
    return t


def _validated(
    adv: Tensor | Sequence[float], lengths: Tensor | Sequence[int]
) -> tuple[Tensor, Tensor, torch.dtype]:
    """(A, L) as float64 on adv's device, plus the dtype to return, after all argument checks."""
    a = _as_vector("adv", adv)
    n_tok = _as_vector("lengths", lengths)
    if a.shape != n_tok.shape:
        raise ValueError(
            f"adv and lengths must have the same shape, got {tuple(a.shape)} and {tuple(n_tok.shape)}"
        )
    if a.numel() == 0:
        raise ValueError("empty batch: need at least one trajectory")
    a64 = a.to(torch.float64)
    l64 = n_tok.to(device=a.device, dtype=torch.float64)
    if not bool(torch.isfinite(a64).all()):
        raise ValueError("adv contains NaN or infinite values")
    if not bool(torch.isfinite(l64).all()) or not bool((l64 == torch.round(l64)).all()):
        raise ValueError("lengths must be finite integer counts of generated action tokens")
    if not bool((l64 > 0).all()):
        raise ValueError("lengths must be > 0: every trajectory needs at least one generated action token")
    return a64, l64, _out_dtype(a)


def _whiten(a: Tensor, w: Tensor, eps: float) -> Tensor:
    """(A - mu_w) / (sd_w + eps); w are frequency weights, hence the divisor sum(w) - 1."""
    total = w.sum()
    mu = (w * a).sum() / total
    var = (w * (a - mu) ** 2).sum() / (total - 1.0)
    return (a - mu) / (torch.sqrt(var) + eps)


def normalize_advantages(
    adv: Tensor | Sequence[float],
    lengths: Tensor | Sequence[int],
    measure: Measure = "token",
    eps: float = 1e-8,
) -> Tensor:
    """Whitened advantages [n] under the token measure (eq. 6) or the trajectory measure (eq. 4).

    adv: [n] scalar advantages, one per trajectory. lengths: [n] generated action tokens L_i
    (observation, tool, prompt and padding tokens are not counted). "trajectory": mu = mean(A),
    var = sum (A - mu)^2 / (n - 1). "token": mu = sum L A / sum L, var = sum L (A - mu)^2 /
    (sum L - 1). Both return (A - mu) / (sqrt(var) + eps) in adv's floating dtype (float32 when adv
    is not floating). A batch whose advantages are all equal comes back as zeros.

    Raises ValueError on an empty batch, shape mismatch, lengths that are not positive integers,
    non-finite adv, an unknown measure, a negative eps, or a zero variance divisor (n == 1 for
    "trajectory", sum L == 1 for "token").
    """
    if measure not in MEASURES:
        raise ValueError(f"unknown measure {measure!r}; expected one of {MEASURES}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    a, n_tok, dtype = _validated(adv, lengths)
    w = n_tok if measure == "token" else torch.ones_like(a)
    if float(w.sum()) <= 1.0:
        what = "sum(lengths) == 1" if measure == "token" else "a single trajectory (n == 1)"
        raise ValueError(f"variance divisor is zero for measure={measure!r}: {what}")
    return _whiten(a, w, eps).to(dtype)


def token_weighted_center(adv: Tensor | Sequence[float], lengths: Tensor | Sequence[int]) -> Tensor:
    """sum_i L_i A_i / sum_i L_i as a 0-d tensor in adv's floating dtype.

    This is the mean advantage a token-mean loss actually sees: zero after token whitening, the
    eq. 5 residual Cov_n(L, A~) / mean(L) after trajectory whitening. Meant for logging.
    """
    a, n_tok, dtype = _validated(adv, lengths)
    return ((n_tok * a).sum() / n_tok.sum()).to(dtype)
