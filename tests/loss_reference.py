"""The clipped policy loss written out token by token (spopp.loss's reference), and the random
batches its tests draw: shared by tests/spopp/test_loss.py and tests/learner/test_staleness.py."""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def reference(logp, old, adv, mask, rollout, clip_low, clip_high, dual_clip, is_cap, token_count):
    """Loss and d loss / d logp, token by token in Python floats, from the written-out formula.

    With r = exp(logp - old): d(-A r)/d logp = -A r; a clipped or dual-clipped token has no
    gradient; the rollout weight is a constant factor.
    """
    loss, grad = 0.0, [[0.0] * len(row) for row in logp]
    for b, row in enumerate(logp):
        for t in range(len(row)):
            if not mask[b][t]:
                continue
            r = math.exp(logp[b][t] - old[b][t])
            a = adv[b][t]
            w = 1.0 if rollout is None else min(math.exp(old[b][t] - rollout[b][t]), is_cap)
            unclipped = -a * r
            clipped = -a * min(max(r, 1.0 - clip_low), 1.0 + clip_high)
            value, slope = (clipped, 0.0) if clipped > unclipped else (unclipped, -a * r)
            if dual_clip is not None and a < 0 and value > -dual_clip * a:
                value, slope = -dual_clip * a, 0.0
            loss += w * value / token_count
            grad[b][t] = w * slope / token_count
    return loss, grad


def random_batch(seed, shape=(6, 11), dtype=F64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(shape, generator=g, dtype=dtype) * 3
    logp = old + 0.6 * torch.randn(shape, generator=g, dtype=dtype)
    adv = torch.randn(shape, generator=g, dtype=dtype)
    rollout = old + 0.6 * torch.randn(shape, generator=g, dtype=dtype)
    mask = torch.rand(shape, generator=g) < 0.7
    return logp, old, adv, mask, rollout
