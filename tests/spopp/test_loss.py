import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_reference import F64, random_batch, reference

from spopp.loss import policy_loss


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dual_clip", [2.0, 3.0, None])
@pytest.mark.parametrize("with_rollout", [True, False])
def test_loss_and_gradient_match_token_loop_reference(seed, dual_clip, with_rollout):
    logp, old, adv, mask, rollout = random_batch(seed)
    rollout = rollout if with_rollout else None
    token_count = float(mask.sum()) + 3.0 if seed == 2 else None
    logp.requires_grad_(True)
    loss, _ = policy_loss(
        logp,
        old,
        adv,
        mask,
        rollout_logp=rollout,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=dual_clip,
        is_cap=1.5,
        token_count=token_count,
    )
    loss.backward()
    ref_loss, ref_grad = reference(
        logp.tolist(),
        old.tolist(),
        adv.tolist(),
        mask.tolist(),
        None if rollout is None else rollout.tolist(),
        0.2,
        0.28,
        dual_clip,
        1.5,
        token_count if token_count is not None else float(mask.sum()),
    )
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(logp.grad, torch.tensor(ref_grad, dtype=F64), rtol=1e-12, atol=1e-15)


def test_random_batches_exercise_every_branch():
    # Guards the reference test above: it only means something if all branches occur.
    logp, old, adv, mask, rollout = random_batch(0)
    r = torch.exp(logp - old)[mask]
    a = adv[mask]
    assert bool(((a > 0) & (r > 1.28)).any()) and bool(((a < 0) & (r < 0.8)).any())
    assert bool(((a < 0) & (r > 2.0)).any()) and bool(((r > 0.8) & (r < 1.28)).any())
    assert bool((torch.exp(old - rollout)[mask] > 1.5).any())


def one_token(log_ratio, adv, **kwargs):
    logp = torch.tensor([[log_ratio]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=F64)
    loss, stats = policy_loss(logp, old, torch.tensor([[adv]], dtype=F64), torch.ones(1, 1), **kwargs)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def test_dual_clip_caps_only_negative_advantages():
    # r = 10, A = -1: PPO term -A r = 10 is capped at -c A = 2; no gradient.
    loss, grad, stats = one_token(math.log(10.0), -1.0, dual_clip=2.0)
    assert loss == pytest.approx(2.0) and grad == 0.0
    assert stats["dual_clip_fraction"] == 1.0 and stats["clip_fraction"] == 1.0
    # Same token without Dual-Clip: the unbounded PPO term and its gradient -A r.
    loss, grad, stats = one_token(math.log(10.0), -1.0, dual_clip=None)
    assert loss == pytest.approx(10.0) and grad == pytest.approx(10.0)
    assert stats["dual_clip_fraction"] == 0.0
    # r = 10, A = +1: the upper clip binds (-1.28); a cap -c A = -2 must not apply.
    loss, grad, stats = one_token(math.log(10.0), 1.0, dual_clip=2.0)
    assert loss == pytest.approx(-1.28) and grad == 0.0
    assert stats["dual_clip_fraction"] == 0.0 and stats["clip_fraction"] == 1.0
    # r = 1.5 < c, A = -1: below the cap the PPO term stays, with gradient -A r.
    loss, grad, _ = one_token(math.log(1.5), -1.0, dual_clip=2.0)
    assert loss == pytest.approx(1.5) and grad == pytest.approx(1.5)


def test_rollout_weight_is_detached_capped_and_scales_the_loss():
    logp, old, adv, mask, _ = random_batch(3)
    logp.requires_grad_(True)
    base, _ = policy_loss(logp, old, adv, mask)
    (base_grad,) = torch.autograd.grad(base, logp)
    # A uniform weight 1.5 below the cap scales loss and gradient by 1.5.
    rollout = (old - math.log(1.5)).requires_grad_(True)
    old_leaf = old.clone().requires_grad_(True)
    adv_leaf = adv.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, old_leaf, adv_leaf, mask, rollout_logp=rollout, is_cap=2.0)
    loss.backward()
    assert rollout.grad is None and old_leaf.grad is None and adv_leaf.grad is None
    assert loss.item() == pytest.approx(1.5 * base.item(), rel=1e-12)
    torch.testing.assert_close(logp.grad, 1.5 * base_grad, rtol=1e-12, atol=1e-15)
    assert stats["is_weight_mean"] == pytest.approx(1.5) and stats["is_weight_max"] == pytest.approx(1.5)
    assert stats["is_capped_fraction"] == 0.0
    # A weight of 5 is cut to the cap 2.
    loss, stats = policy_loss(logp, old, adv, mask, rollout_logp=old - math.log(5.0), is_cap=2.0)
    assert loss.item() == pytest.approx(2.0 * base.item(), rel=1e-12)
    assert stats["is_weight_max"] == 2.0 and stats["is_capped_fraction"] == 1.0


def test_is_capped_fraction_counts_tokens_at_the_cap():
    old = torch.zeros(1, 5, dtype=F64)
    # Raw weights 0.5, 1, 3, 2.6, 9 (the last one masked out), cap 2.5.
    rollout = -torch.log(torch.tensor([[0.5, 1.0, 3.0, 2.6, 9.0]], dtype=F64))
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.float32)
    _, stats = policy_loss(
        old.clone(), old, torch.ones(1, 5, dtype=F64), mask, rollout_logp=rollout, is_cap=2.5
    )
    assert stats["is_capped_fraction"] == pytest.approx(0.5)
    assert stats["is_weight_mean"] == pytest.approx((0.5 + 1.0 + 2.5 + 2.5) / 4)
    assert stats["is_weight_max"] == pytest.approx(2.5)
    assert stats["tokens"] == 4.0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cuts=st.lists(st.integers(1, 7), min_size=1, max_size=3, unique=True))
def test_micro_batches_with_global_token_count_sum_to_the_whole_batch(seed, cuts):
    logp, old, adv, mask, rollout = random_batch(seed, shape=(8, 13))
    logp.requires_grad_(True)
    whole, _ = policy_loss(logp, old, adv, mask, rollout_logp=rollout)
    (whole_grad,) = torch.autograd.grad(whole, logp)
    total = mask.sum()
    bounds = [0, *sorted(cuts), 8]
    parts = [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    summed_loss, summed_grad = 0.0, torch.zeros_like(logp)
    for s in parts:
        part, _ = policy_loss(logp[s], old[s], adv[s], mask[s], rollout_logp=rollout[s], token_count=total)
        summed_loss += part.item()
        summed_grad += torch.autograd.grad(part, logp)[0]
    assert summed_loss == pytest.approx(whole.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(summed_grad, whole_grad, rtol=1e-12, atol=1e-15)


def test_unit_ratio_gives_minus_token_mean_advantage():
    logp, _, adv, mask, _ = random_batch(4)
    loss, stats = policy_loss(logp, logp.clone(), adv, mask)
    assert loss.item() == pytest.approx(-float(adv[mask].mean()), rel=1e-12)
    assert stats["clip_fraction"] == 0.0 and stats["approx_kl"] == 0.0


def test_stats_on_hand_constructed_tokens():
    # Ratios 1.5, 0.5, 1.0, 3.0 with advantages +1, -1, +1, -1, plus a padded token holding junk.
    ratios = [1.5, 0.5, 1.0, 3.0]
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, float("nan")]], dtype=F64)
    logp = old.clone()
    logp[0, :4] += torch.log(torch.tensor(ratios, dtype=F64))
    logp[0, 4] = float("inf")
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, float("nan")]], dtype=F64)
    mask = torch.tensor([[True, True, True, True, False]])
    logp.requires_grad_(True)
    loss, stats = policy_loss(logp, old, adv, mask)
    # Token 1: upper clip (-1.28 > -1.5). Token 2: lower clip (0.8 > 0.5). Token 3: no clip.
    # Token 4: PPO term 3 capped at 2 by Dual-Clip.
    assert stats["clip_fraction"] == pytest.approx(3 / 4)
    assert stats["dual_clip_fraction"] == pytest.approx(1 / 4)
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 1.0 + 2.0) / 4)
    k3 = [1 / r - 1 + math.log(r) for r in ratios]
    assert stats["approx_kl"] == pytest.approx(sum(k3) / 4, rel=1e-12)
    assert stats["tokens"] == 4.0 and stats["is_weight_mean"] == 1.0 and stats["is_capped_fraction"] == 0.0
    assert all(isinstance(v, float) for v in stats.values())
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, -0.25, 0.0, 0.0])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_approx_kl_is_nonnegative_and_matches_k3(seed):
    logp, old, adv, mask, _ = random_batch(seed, dtype=torch.float32)
    _, stats = policy_loss(logp, old, adv, mask)
    x = (old - logp)[mask].double()
    assert stats["approx_kl"] >= 0.0
    assert stats["approx_kl"] == pytest.approx(float((torch.exp(x) - 1 - x).mean()), rel=1e-5)


def test_empty_micro_batch_with_explicit_count_gives_attached_zero_loss():
    logp, old, adv, _, _ = random_batch(5, shape=(2, 4))
    logp.requires_grad_(True)
    mask = torch.zeros(2, 4)
    loss, stats = policy_loss(logp, old, adv, mask, token_count=17)
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    assert stats["tokens"] == 0.0 and stats["clip_fraction"] == 0.0


def test_float32_mask_and_token_count_tensor_are_accepted():
    logp, old, adv, mask, _ = random_batch(6, dtype=torch.float32)
    a, _ = policy_loss(logp, old, adv, mask)
    b, _ = policy_loss(logp, old, adv, mask.float(), token_count=mask.sum())
    assert a.dtype == torch.float32 and a.item() == pytest.approx(b.item(), rel=1e-6)


def bad_cases():
    logp, old, adv, mask, rollout = random_batch(7, shape=(2, 3))
    nan_at_token = old.clone()
    nan_at_token[mask.nonzero()[0].tolist()] = float("nan")
    return [
        ((logp, old[:, :2], adv, mask), {}, "shape"),
        ((logp, old, adv, mask[:1]), {}, "shape"),
        ((logp, old, adv, mask), {"rollout_logp": rollout[:1]}, "shape"),
        ((logp, old, adv, torch.zeros_like(mask)), {}, "token count"),
        ((logp, old, adv, mask), {"token_count": 0}, "token count"),
        ((logp, old, adv, mask), {"token_count": -3.0}, "token count"),
        ((logp, nan_at_token, adv, mask), {}, "old_logp has NaN"),
        ((logp, old, adv, mask * 0.5), {}, "0 and 1"),
        ((logp, old, adv, mask), {"dual_clip": 1.0}, "dual_clip"),
        ((logp, old, adv, mask), {"clip_low": 1.0}, "clip_low"),
        ((logp, old, adv, mask), {"clip_high": -0.1}, "clip_high"),
        ((logp, old, adv, mask), {"is_cap": 0.0}, "is_cap"),
        ((logp.long(), old, adv, mask), {}, "floating"),
    ]


@pytest.mark.parametrize(("args", "kwargs", "match"), bad_cases())
def test_bad_arguments_raise(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        policy_loss(*args, **kwargs)


def test_non_finite_logp_at_counted_token_raises():
    logp, old, adv, _, _ = random_batch(8, shape=(1, 3))
    logp[0, 1] = -float("inf")
    with pytest.raises(ValueError, match="logp has NaN"):
        policy_loss(logp, old, adv, torch.ones(1, 3))
    # The same value under padding is fine.
    loss, _ = policy_loss(logp, old, adv, torch.tensor([[1.0, 0.0, 1.0]]))
    assert math.isfinite(loss.item())
