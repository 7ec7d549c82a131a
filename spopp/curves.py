"""Learning-curve summaries (paper appendix A) and paired comparisons across matched replicates.

A curve is a sequence of evaluation rewards r_1..r_T taken at equally spaced steps. The summaries
are plain Python so that analysis scripts need neither torch nor numpy. Paired comparisons truncate
each (method, baseline) pair to its common length first: a run that stopped early must not be
scored against the other's longer, usually better, tail.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

Curve = Sequence[float]
Metric = Callable[[Curve], float]

C10_POINTS = 10


def _curve(rewards: Curve, name: str = "rewards") -> list[float]:
    values = [float(r) for r in rewards]
    if not values:
        raise ValueError(f"{name} is empty: a curve needs at least one point")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name} contains NaN or infinite values")
    return values


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def auc_trapezoid(rewards: Curve) -> float:
    """Normalised trapezoid area: r_1 if T == 1, else sum_t (r_t + r_{t+1}) / 2 / (T - 1)."""
    r = _curve(rewards)
    if len(r) == 1:
        return r[0]
    return math.fsum((a + b) / 2.0 for a, b in zip(r, r[1:], strict=False)) / (len(r) - 1)


def step_mean(rewards: Curve) -> float:
    """Mean reward over all evaluation points."""
    return _mean(_curve(rewards))


def final_mean(rewards: Curve, k: int = 5) -> float:
    """Mean of the last k points; the curve must have at least k points."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    r = _curve(rewards)
    if len(r) < k:
        raise ValueError(f"final_mean needs at least k={k} points, got {len(r)}")
    return _mean(r[-k:])


def learning_composite(rewards: Curve) -> float:
    """C10 = (AUC of the first 10 points + mean of points 6..10) / 2; needs at least 10 points."""
    r = _curve(rewards)
    if len(r) < C10_POINTS:
        raise ValueError(f"learning_composite needs at least {C10_POINTS} points, got {len(r)}")
    head = r[:C10_POINTS]
    return 0.5 * (auc_trapezoid(head) + _mean(head[5:]))


def truncate_pair(a: Curve, b: Curve) -> tuple[list[float], list[float]]:
    """Both curves cut to their common length min(len(a), len(b))."""
    ra, rb = _curve(a, "first curve"), _curve(b, "second curve")
    n = min(len(ra), len(rb))
    return ra[:n], rb[:n]


def paired_difference(
    method_runs: Sequence[Curve], baseline_runs: Sequence[Curve], metric: Metric
) -> tuple[float, float]:
    """(mean, sample s.d.) of d_i = metric(method_i) - metric(baseline_i) over matched replicates.

    Replicate i of the method is paired with replicate i of the baseline, each pair truncated to
    its common length before scoring. The s.d. uses divisor n - 1 and is NaN for a single pair,
    where it is undefined.
    """
    if len(method_runs) != len(baseline_runs):
        raise ValueError(
            f"need matched replicates: {len(method_runs)} method runs vs {len(baseline_runs)} baseline runs"
        )
    if not method_runs:
        raise ValueError("no replicates to compare")
    diffs = []
    for i, (m, b) in enumerate(zip(method_runs, baseline_runs, strict=True)):
        try:
            rm, rb = truncate_pair(m, b)
        except ValueError as err:
            raise ValueError(f"replicate {i}: {err}") from err
        diffs.append(float(metric(rm)) - float(metric(rb)))
    mean = _mean(diffs)
    if len(diffs) == 1:
        return mean, math.nan
    sd = math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    return mean, sd
