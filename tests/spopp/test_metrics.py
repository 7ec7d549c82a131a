import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spopp.metrics import (
    auc_trapezoid,
    final_mean,
    learning_composite,
    paired_difference,
    step_mean,
    truncate_pair,
)

rewards = st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=30)


def test_auc_trapezoid_on_hand_computed_curves():
    assert auc_trapezoid([0.7]) == 0.7
    assert auc_trapezoid([0.0, 1.0]) == pytest.approx(0.5)
    # Trapezoids 0.5 and 0.75 over T - 1 = 2 intervals.
    assert auc_trapezoid([0.0, 1.0, 0.5]) == pytest.approx(0.625)
    # Endpoints weigh half: (0.5 * 1 + 0 + 0 + 0.5 * 0) / 3.
    assert auc_trapezoid([1.0, 0.0, 0.0, 0.0]) == pytest.approx(1 / 6)


@given(rewards)
def test_auc_of_a_constant_curve_is_the_constant_and_lies_in_range(curve):
    assert auc_trapezoid([curve[0]] * len(curve)) == pytest.approx(curve[0])
    assert min(curve) - 1e-12 <= auc_trapezoid(curve) <= max(curve) + 1e-12


def test_step_mean_and_final_mean():
    assert step_mean([1.0, 2.0, 3.0, 6.0]) == pytest.approx(3.0)
    curve = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert final_mean(curve) == pytest.approx(5.0)
    assert final_mean(curve, k=3) == pytest.approx(6.0)
    assert final_mean(curve, k=7) == pytest.approx(4.0)


def test_learning_composite_on_a_constructed_curve():
    # AUC of a step at point 6: (0.5 + 4) / 9 = 0.5; mean of points 6..10 = 1; C10 = 0.75.
    step = [0.0] * 5 + [1.0] * 5
    assert learning_composite(step) == pytest.approx(0.75)
    # Only the first 10 points count.
    assert learning_composite(step + [0.0, 0.0, 0.0]) == pytest.approx(0.75)
    # A linear ramp 0, 0.1, ..., 0.9: AUC 0.45, late mean 0.7.
    assert learning_composite([t / 10 for t in range(10)]) == pytest.approx(0.575)


def test_truncate_pair_cuts_to_common_length():
    assert truncate_pair([1, 2, 3], [4, 5]) == ([1.0, 2.0], [4.0, 5.0])
    assert truncate_pair([1], [4, 5, 6]) == ([1.0], [4.0])


def test_paired_difference_truncates_each_pair_before_scoring():
    method = [[0.0, 1.0, 1.0], [1.0, 1.0]]
    baseline = [[0.0, 0.0], [0.0, 0.0, 0.0, 5.0]]
    # Pair 1 at length 2: 0.5 - 0 (not 0.75 - 0). Pair 2 at length 2: 1 - 0 (not 1 - 5/6).
    mean, sd = paired_difference(method, baseline, auc_trapezoid)
    assert mean == pytest.approx(0.75)
    assert sd == pytest.approx(math.sqrt((0.25**2 + 0.25**2) / 1))


def test_paired_difference_uses_sample_sd_and_nan_for_one_pair():
    method = [[2.0], [4.0], [6.0]]
    baseline = [[1.0], [2.0], [3.0]]
    mean, sd = paired_difference(method, baseline, step_mean)
    assert mean == pytest.approx(2.0)
    assert sd == pytest.approx(1.0)  # divisor n - 1 = 2; divisor n would give sqrt(2/3)
    mean, sd = paired_difference([[0.5, 0.7]], [[0.1, 0.3, 0.9]], step_mean)
    assert mean == pytest.approx(0.4) and math.isnan(sd)


def test_paired_difference_with_other_metrics():
    method = [[float(t) for t in range(12)]]
    baseline = [[0.0] * 10]
    mean, _ = paired_difference(method, baseline, lambda r: final_mean(r, k=2))
    assert mean == pytest.approx(8.5)
    mean, _ = paired_difference(method, baseline, learning_composite)
    assert mean == pytest.approx(0.5 * (4.5 + 7.0))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: auc_trapezoid([]), "empty"),
        (lambda: step_mean([0.1, float("nan")]), "NaN"),
        (lambda: auc_trapezoid([0.1, float("inf")]), "NaN or infinite"),
        (lambda: final_mean([0.1, 0.2, 0.3], k=5), "at least k=5"),
        (lambda: final_mean([0.1, 0.2], k=0), "positive integer"),
        (lambda: learning_composite([0.5] * 9), "at least 10"),
        (lambda: truncate_pair([], [0.1]), "empty"),
        (lambda: paired_difference([[0.1]], [[0.1], [0.2]], step_mean), "matched"),
        (lambda: paired_difference([], [], step_mean), "no replicates"),
        (lambda: paired_difference([[0.1], []], [[0.1], [0.2]], step_mean), "replicate 1"),
        (lambda: paired_difference([[0.1, float("nan")]], [[0.1, 0.2]], step_mean), "NaN"),
    ],
)
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_users_finishes_are_labelled_from_a_bounded_set():
    """A plug-in environment names its own finishes; /metrics keeps a series per label for good,
    so past MAX_FINISH_LABELS distinct ones the rest are counted as "other"."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from services.rollout.metrics import MAX_FINISH_LABELS, RolloutMetrics

    m = RolloutMetrics()
    for i in range(MAX_FINISH_LABELS + 10):
        ep = SimpleNamespace(finish_reason=f"finish-{i}", generated_tokens=1, info={}, timings={})
        m.observe_episode(ep)
    m.observe_episode(SimpleNamespace(finish_reason="finish-0", generated_tokens=1, info={}, timings={}))
    text = generate_latest(m.registry).decode()
    labels = {line.split('finish_reason="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("spopp_rollout_episodes_total{")}  # fmt: skip
    assert len(labels) == MAX_FINISH_LABELS + 1 and "other" in labels
    assert 'spopp_rollout_episodes_total{finish_reason="other"} 10.0' in text
    assert 'spopp_rollout_episodes_total{finish_reason="finish-0"} 2.0' in text
