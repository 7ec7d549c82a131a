"""The summaries behind the report's tables: areas, end rewards, C10 and mean ± s.d. of pairs.

Pure functions, no I/O. The curve summaries are the library's (`spopp.curves`, the paper's
appendix "Metric definitions"); this module adds the report's relaxations for short curves
(end reward and C10 over fewer than five / ten points) and the aggregates of paired differences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from spopp.curves import C10_POINTS, auc_trapezoid, final_mean, step_mean

AREAS = ("trapezoid", "mean")
END_POINTS = 5
# Points in percentage points: differences of rewards in [0, 1] are reported x100, as in the paper.
POINTS = 100.0


def area(rewards: Sequence[float], kind: str = "trapezoid") -> float:
    """Normalized area under r_1..r_T: the trapezoid rule (default) or the step mean (rectangles)."""
    if kind == "trapezoid":
        return auc_trapezoid(rewards)
    if kind == "mean":
        return step_mean(rewards)
    raise ValueError(f"unknown area rule {kind!r}; choose one of {', '.join(AREAS)}")


def end_reward(rewards: Sequence[float]) -> float:
    """Mean of the final five points, or of all points when the curve is shorter."""
    return final_mean(rewards, k=min(END_POINTS, len(rewards)) or 1)


def c10(rewards: Sequence[float]) -> float:
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


@dataclass(frozen=True)
class Summary:
    """Mean and sample s.d. (n - 1 denominator; None with a single value) of n values."""

    mean: float
    sd: float | None
    n: int

    def as_dict(self) -> dict[str, float | int | None]:
        return {"mean": self.mean, "sd": self.sd, "n": self.n}


def summarize(values: Sequence[float]) -> Summary:
    if not values:
        raise ValueError("nothing to summarize: no values")
    mean = math.fsum(values) / len(values)
    if len(values) == 1:
        return Summary(mean, None, 1)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return Summary(mean, sd, len(values))


def wins(differences: Sequence[float]) -> int:
    """How many paired differences favour the treatment (strictly positive)."""
    return sum(1 for d in differences if d > 0)


# The confidence level of every interval the map and the report print.
LEVEL = 0.95


def sign_test(won: int, lost: int) -> float:
    """Two-sided exact sign test: the probability, with no effect (each non-tied pair won with
    probability 1/2), of a split at least as uneven as won:lost. Ties are left out, as is usual; 1.0
    with no untied pair."""
    m = won + lost
    if m == 0:
        return 1.0
    tail = math.fsum(math.comb(m, k) for k in range(min(won, lost) + 1)) / 2**m
    return min(1.0, 2 * tail)


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with df degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(p, df))


def paired(differences: Sequence[float], level: float = LEVEL) -> dict[str, float | int | None | list[float]]:
    """Paired differences summarized for a reader who must judge them: mean, sample s.d., standard
    error, the t interval at `level` with n - 1 degrees of freedom (None with one pair), pairs won,
    lost and tied, and the two-sided sign test's p; the values themselves kept as per_seed."""
    s = summarize(differences)
    se = None if s.sd is None else s.sd / math.sqrt(s.n)
    lo = hi = None
    if se is not None:
        half = t_quantile(0.5 + level / 2, s.n - 1) * se
        lo, hi = s.mean - half, s.mean + half
    won = wins(differences)
    lost = sum(1 for d in differences if d < 0)
    return {
        "mean": s.mean, "sd": s.sd, "se": se, "n": s.n, "df": s.n - 1, "level": level, "lo": lo, "hi": hi,
        "won": won, "lost": lost, "tied": s.n - won - lost, "sign_p": sign_test(won, lost),
        "per_seed": list(differences),
    }  # fmt: skip


def trailing_mean(values: Sequence[float], window: int = 5) -> list[float]:
    """Each point replaced by the mean of itself and up to window - 1 points before it (the figure's smoothing)."""
    if window < 1:
        raise ValueError(f"window must be positive, got {window}")
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(math.fsum(chunk) / len(chunk))
    return out


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """Linear interpolation of the points (xs, ys) at x; None outside [xs[0], xs[-1]] (no extrapolation)."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(len(xs) - 1):
        if xs[i] <= x <= xs[i + 1]:
            if xs[i + 1] == xs[i]:
                return ys[i]
            w = (x - xs[i]) / (xs[i + 1] - xs[i])
            return ys[i] + w * (ys[i + 1] - ys[i])
    return ys[-1]  # a single point, at x
