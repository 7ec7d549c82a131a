"""Learning-curve summaries (paper appendix A) and paired comparisons across matched replicates.

A curve is a sequence of evaluation rewards r_1..r_T taken at equally spaced steps. The summaries
are plain Python so that analysis scripts need neither torch nor numpy. Paired comparisons truncate
each (method, baseline) pair to its common length first: a run that stopped early must not be
scored against the other's longer, usually better, tail.

The paper's definitions (`auc_trapezoid`, `final_mean`, `learning_composite`) refuse a curve too
short for them; `area`, `end_reward` and `c10` are what the report's tables and the studies' maps
print, relaxed for short curves (end reward and C10 over fewer than five / ten points, C10 then
named by `c10_label`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

Curve = Sequence[float]
Metric = Callable[[Curve], float]

C10_POINTS = 10
AREAS = ("trapezoid", "mean")
END_POINTS = 5
# Points in percentage points: differences of rewards in [0, 1] are reported x100, as in the paper.
POINTS = 100.0


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


def area(rewards: Curve, kind: str = "trapezoid") -> float:
    """Normalized area under r_1..r_T: the trapezoid rule (default) or the step mean (rectangles)."""
    if kind == "trapezoid":
        return auc_trapezoid(rewards)
    if kind == "mean":
        return step_mean(rewards)
    raise ValueError(f"unknown area rule {kind!r}; choose one of {', '.join(AREAS)}")


def end_reward(rewards: Curve) -> float:
    """Mean of the final five points, or of all points when the curve is shorter."""
    return final_mean(rewards, k=min(END_POINTS, len(rewards)) or 1)


def c10(rewards: Curve) -> float:
    """Ablation composite: 0.5 * (AUC_trapezoid(r_1..r_10) + mean(r_6..r_10)).

    A curve shorter than ten points uses what it has, 0.5 * (AUC(r_1..r_T) + its end reward); the
    caller warns, since such values are not comparable with ten-point ones.
    """
    head = list(rewards[:C10_POINTS])
    # With ten points the final five are r_6..r_10, so one formula covers both cases.
    return 0.5 * (auc_trapezoid(head) + end_reward(head))


def c10_label(points) -> str:
    """C10's name where curves of `points` points (an iterable of counts) went into it: "C10" when
    every one had ten or more, else "C10 (5 points)" (or "C10 (3–5 points)"), since a C10 of fewer
    points is not the paper's ten-point C10 and is not comparable with it."""
    counts = sorted(set(points))
    if not counts or counts[0] >= C10_POINTS:
        return "C10"
    lo, hi = counts[0], min(counts[-1], C10_POINTS)
    return f"C10 ({lo} points)" if lo == hi else f"C10 ({lo}–{hi} points)"
