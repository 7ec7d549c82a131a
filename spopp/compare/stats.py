"""Paired differences over matched seeds, summarized for a reader who must judge them, and the tests
over several of them: mean ± s.d., the t interval, pairs won and the sign test (`paired`); the paired
t test's p (`t_p`), Holm's adjustment over a family of p's (`holm`) and Fisher's combination of them
(`fisher`).

Pure functions, no I/O; the report's tables and the studies (services/study) both use them. The
t quantiles and the t and chi-square tails come from scipy (the `report` extra), imported only
where one is needed; the rest is plain Python.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# The confidence level of every interval the map and the report print.
LEVEL = 0.95


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


def t_p(d: dict) -> float | None:
    """The two-sided p of the paired t test of a difference (the test its t interval inverts, n − 1
    degrees of freedom): None with one pair; with no spread, 1 when the mean is 0 and 0 otherwise."""
    if d.get("mean") is None or d.get("se") is None:
        return None
    if d["se"] == 0:
        return 1.0 if d["mean"] == 0 else 0.0
    from scipy.stats import t

    return float(2 * t.sf(abs(d["mean"]) / d["se"], d["df"]))


def holm(ps: list[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values, in the order given: sorted ascending, the i-th smallest
    (from 0) of the m known p's times m − i, never below the one before it, at most 1. A None stays
    None and is not counted in m."""
    known = sorted((p, i) for i, p in enumerate(ps) if p is not None)
    out: list[float | None] = [None] * len(ps)
    running = 0.0
    for rank, (p, i) in enumerate(known):
        running = max(running, min(1.0, (len(known) - rank) * p))
        out[i] = running
    return out


def fisher(ps: list[float | None]) -> dict[str, float | int | None]:
    """Fisher's combination of k independent p's (None left out): X = −2 Σ ln p, chi-square with 2k
    degrees of freedom when every null holds. It asks whether any of them differs, not which nor in
    which direction. A p of 0 makes the combined p 0 (X is infinite and not written)."""
    known = [p for p in ps if p is not None]
    if not known:
        return {"k": 0, "statistic": None, "df": 0, "p": None}
    if min(known) == 0:
        return {"k": len(known), "statistic": None, "df": 2 * len(known), "p": 0.0}
    from scipy.stats import chi2

    x = -2 * math.fsum(math.log(p) for p in known)
    return {"k": len(known), "statistic": x, "df": 2 * len(known), "p": float(chi2.sf(x, 2 * len(known)))}


# A sign test over n pairs cannot reach p < 0.05 below this many pairs (its floor 2 / 2^n is 0.0625
# at n = 5, 0.03125 at n = 6): the fewest pairs a comparison that must answer is sized to.
SIGN_TEST_MIN_PAIRS = 6


def sign_floor(n: int) -> float:
    """The smallest two-sided p the exact sign test can give over n untied pairs: every pair won."""
    return sign_test(n, 0)


def t_power(n: int, effect: float, sd: float, alpha: float = 1 - LEVEL) -> float:
    """Power of the two-sided paired t test at level `alpha` over n pairs whose differences have
    mean `effect` and s.d. `sd`: P(|T| > t_{1-alpha/2, n-1}) under the noncentral t with n - 1
    degrees of freedom and noncentrality effect / sd * sqrt(n). Not the normal approximation,
    which overstates the power of few pairs (at n = 2 it ignores that one degree of freedom
    leaves a t quantile of 12.7)."""
    if n < 2:
        return 0.0
    if sd <= 0:
        return 1.0 if effect != 0 else alpha
    from scipy.stats import nct, t

    df = n - 1
    crit = float(t.ppf(1 - alpha / 2, df))
    ncp = effect / sd * math.sqrt(n)
    power = float(nct.sf(crit, df, ncp) + nct.cdf(-crit, df, ncp))
    if math.isfinite(power):
        return power
    # scipy's noncentral t answers NaN at one degree of freedom and a large noncentrality; the
    # definition, integrated over the chi-square of the s.d.'s estimate, does not fail there.
    from scipy import integrate
    from scipy.stats import chi2, norm

    def given(v: float) -> float:
        scale = math.sqrt(v / df)
        return (norm.sf(crit * scale - ncp) + norm.cdf(-crit * scale - ncp)) * chi2.pdf(v, df)

    return float(integrate.quad(given, 0, math.inf)[0])


def pairs_for_power(
    effect: float, sd: float | None, power: float = 0.8, alpha: float = 1 - LEVEL,
    n_min: int = SIGN_TEST_MIN_PAIRS, n_max: int = 100_000,
) -> int:  # fmt: skip
    """The fewest pairs n >= n_min at which the two-sided paired t test reaches `power` against a
    mean difference `effect` with differences of s.d. `sd` (t_power); ValueError without an s.d.,
    with no effect, or when even n_max pairs would not do."""
    if sd is None or not math.isfinite(sd):
        raise ValueError("no standard deviation of the paired differences: the pilot needs two pairs or more")
    if effect == 0 or not math.isfinite(effect):
        raise ValueError(f"the effect to detect must be a finite non-zero number, got {effect!r}")
    n = max(2, n_min)
    if t_power(n, effect, sd, alpha) >= power:
        return n
    # Power grows with n: double until it is reached, then bisect.
    hi = n
    while t_power(hi, effect, sd, alpha) < power:
        if hi >= n_max:
            raise ValueError(f"more than {n_max} pairs would be needed (effect {effect}, s.d. {sd})")
        hi = min(2 * hi, n_max)
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if t_power(mid, effect, sd, alpha) < power else (lo, mid)
    return max(hi, n)
