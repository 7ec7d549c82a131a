import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from spopp.advantages import normalize_advantages, token_weighted_center

batches = st.lists(
    st.tuples(
        st.floats(-10.0, 10.0, allow_nan=False, allow_infinity=False),
        st.integers(1, 200),
    ),
    min_size=2,
    max_size=24,
)


def split(batch):
    adv = torch.tensor([a for a, _ in batch], dtype=torch.float64)
    lengths = torch.tensor([n for _, n in batch], dtype=torch.int64)
    return adv, lengths


def weighted_moments(x, w):
    """Mean and variance (divisor sum(w) - 1) of x under frequency weights w, in Python floats."""
    x, w = [float(v) for v in x], [float(v) for v in w]
    total = math.fsum(w)
    mu = math.fsum(xi * wi for xi, wi in zip(x, w, strict=True)) / total
    var = math.fsum(wi * (xi - mu) ** 2 for xi, wi in zip(x, w, strict=True)) / (total - 1.0)
    return mu, var


@settings(max_examples=150, deadline=None)
@given(batches)
def test_token_measure_has_zero_token_mean_and_unit_token_variance(batch):
    adv, lengths = split(batch)
    _, var_in = weighted_moments(adv, lengths)
    assume(var_in > 1e-6)
    out = normalize_advantages(adv, lengths, measure="token")
    assert out.dtype == torch.float64 and out.shape == adv.shape
    mu, var = weighted_moments(out, lengths)
    assert abs(mu) < 1e-9
    # Unit variance up to the eps in the denominator (default 1e-8).
    assert var == pytest.approx(var_in / (math.sqrt(var_in) + 1e-8) ** 2, rel=1e-9)
    assert var == pytest.approx(1.0, rel=1e-4)
    assert float(token_weighted_center(out, lengths)) == pytest.approx(0.0, abs=1e-9)


@settings(max_examples=150, deadline=None)
@given(batches)
def test_trajectory_measure_has_zero_mean_and_unit_sample_variance(batch):
    adv, lengths = split(batch)
    _, var_in = weighted_moments(adv, [1.0] * len(adv))
    assume(var_in > 1e-6)
    out = normalize_advantages(adv, lengths, measure="trajectory")
    mu, var = weighted_moments(out, [1.0] * len(out))
    assert abs(mu) < 1e-9
    assert var == pytest.approx(var_in / (math.sqrt(var_in) + 1e-8) ** 2, rel=1e-9)
    assert var == pytest.approx(1.0, rel=1e-4)


@settings(max_examples=150, deadline=None)
@given(batches)
def test_trajectory_whitening_leaves_the_eq5_residual(batch):
    adv, lengths = split(batch)
    assume(weighted_moments(adv, [1.0] * len(adv))[1] > 1e-6)
    out = normalize_advantages(adv, lengths, measure="trajectory")
    x, n_tok = [float(v) for v in out], [float(v) for v in lengths]
    n = len(x)
    mean_l, mean_x = math.fsum(n_tok) / n, math.fsum(x) / n
    cov_n = math.fsum((li - mean_l) * (xi - mean_x) for li, xi in zip(n_tok, x, strict=True)) / n
    residual = float(token_weighted_center(out, lengths))
    assert residual == pytest.approx(cov_n / mean_l, abs=1e-9)


def test_eq5_residual_is_nonzero_when_length_and_advantage_covary():
    # The long trajectory succeeded, the short one failed: a token-mean loss favours length.
    adv, lengths = [1.0, 0.0], [10, 1]
    traj = normalize_advantages(adv, lengths, measure="trajectory")
    expected = (10 - 1) * math.sqrt(0.5) / 11
    assert float(token_weighted_center(traj, lengths)) == pytest.approx(expected, rel=1e-6)
    assert float(token_weighted_center(traj, lengths)) > 0.5
    tok = normalize_advantages(adv, lengths, measure="token")
    assert float(token_weighted_center(tok, lengths)) == pytest.approx(0.0, abs=1e-7)


def test_hand_computed_values():
    # Trajectory: mu = 2, var = (1 + 0 + 1) / 2 = 1.
    out = normalize_advantages([1.0, 2.0, 3.0], [5, 1, 1], measure="trajectory", eps=0.0)
    assert out.tolist() == pytest.approx([-1.0, 0.0, 1.0])
    # Token, lengths [3, 1]: mu = (3*0 + 1*4) / 4 = 1, var = (3*1 + 9) / 3 = 4, sd = 2.
    out = normalize_advantages([0.0, 4.0], [3, 1], measure="token", eps=0.0)
    assert out.tolist() == pytest.approx([-0.5, 1.5])


def test_measures_coincide_for_unit_lengths_and_differ_only_in_scale_for_equal_lengths():
    adv = torch.tensor([0.3, -1.2, 2.5, 0.0, 0.7], dtype=torch.float64)
    ones = torch.ones(5, dtype=torch.int64)
    tok = normalize_advantages(adv, ones, measure="token", eps=0.0)
    traj = normalize_advantages(adv, ones, measure="trajectory", eps=0.0)
    torch.testing.assert_close(tok, traj, rtol=1e-14, atol=0.0)
    # Equal lengths c: same centre; token divisor n c - 1 vs trajectory n - 1 changes only the scale.
    n, c = 5, 7
    tok = normalize_advantages(adv, torch.full((n,), c), measure="token", eps=0.0)
    traj = normalize_advantages(adv, torch.full((n,), c), measure="trajectory", eps=0.0)
    torch.testing.assert_close(tok, traj * math.sqrt((n * c - 1) / (c * (n - 1))), rtol=1e-13, atol=0.0)


def test_constant_advantages_whiten_to_zero():
    out = normalize_advantages([0.5, 0.5, 0.5], [3, 4, 5])
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_dtypes_and_inputs():
    out32 = normalize_advantages(torch.tensor([1.0, 2.0], dtype=torch.float32), [1, 2])
    assert out32.dtype == torch.float32
    out_int = normalize_advantages([1, 0, 1], torch.tensor([2.0, 3.0, 4.0]))
    assert out_int.dtype == torch.float32
    assert out_int.tolist() == pytest.approx(normalize_advantages([1.0, 0.0, 1.0], [2, 3, 4]).tolist())


def test_float32_input_is_whitened_in_float64():
    # A small spread on a large offset over many tokens: float32 sums would be off by ~1e-2.
    g = torch.Generator().manual_seed(0)
    adv = (1000 + 1e-2 * torch.randn(64, generator=g, dtype=torch.float64)).float()
    lengths = torch.randint(1, 4000, (64,), generator=g)
    out = normalize_advantages(adv, lengths)
    reference = normalize_advantages(adv.double(), lengths)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference, rtol=0.0, atol=1e-6)


@pytest.mark.parametrize(
    ("adv", "lengths", "measure", "match"),
    [
        ([], [], "token", "empty"),
        ([1.0, 2.0], [1, 0], "token", "lengths must be > 0"),
        ([1.0, 2.0], [1, -3], "trajectory", "lengths must be > 0"),
        ([1.0, 2.0], [1.5, 2], "token", "integer"),
        ([1.0, float("nan")], [1, 2], "token", "NaN"),
        ([1.0, float("inf")], [1, 2], "trajectory", "NaN or infinite"),
        ([1.0], [7], "trajectory", "n == 1"),
        ([1.0], [1], "token", "sum\\(lengths\\) == 1"),
        ([1.0, 2.0], [1, 2, 3], "token", "same shape"),
        ([[1.0, 2.0]], [[1, 2]], "token", "1-D"),
        ([1.0, 2.0], [1, 2], "sequence", "unknown measure"),
    ],
)
def test_bad_arguments_raise(adv, lengths, measure, match):
    with pytest.raises(ValueError, match=match):
        normalize_advantages(adv, lengths, measure=measure)


def test_token_measure_accepts_a_single_long_trajectory_and_bad_eps_raises():
    assert normalize_advantages([3.0], [4], measure="token").tolist() == [0.0]
    with pytest.raises(ValueError, match="eps"):
        normalize_advantages([1.0, 2.0], [1, 1], eps=-1.0)
    with pytest.raises(ValueError, match="lengths must be > 0"):
        token_weighted_center([1.0, 2.0], [0, 1])
