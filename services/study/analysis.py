"""The pre-registered analysis of `spopp study compare`: paired differences (treatment − control,
in points of [0, 1] × 100) of the paper's metrics over the common budget.

- **area** (primary): normalized area under the online training-reward curve, the trapezoid rule
  (the paper's ALFWorld comparator) or the step mean (its Math-TIR one), over the updates every
  run reached;
- **final five**: the mean of the last five points of that curve (the paper's secondary);
- **held-out area**: trapezoid area of the evaluator's held-out success, only when every run was
  scored at the same versions, at least HELDOUT_MIN_VERSIONS of them (fewer points make an area
  that a single version decides).

Each metric gets the paired summary of spopp.compare.stats (mean, s.d., s.e., 95 % t interval, sign test),
the two-sided paired t test's p, and Holm's adjustment over the metrics the protocol planned.
"""

from __future__ import annotations

from spopp.compare.stats import holm, paired, t_p
from spopp.metrics import POINTS, area, final_mean

from .measures import RunMeasures

HELDOUT_MIN_VERSIONS = 6
AREA_RULES = {"trapezoid": "trapezoid", "step-mean": "mean"}
FINAL_POINTS = 5


def metrics_planned(primary: str, heldout: bool) -> list[str]:
    """The comparisons a protocol plans, the primary first."""
    names = [f"area ({primary})", "final five"]
    return names + (["held-out area"] if heldout else [])


def heldout_usable(runs: list[RunMeasures]) -> tuple[bool, str]:
    """Whether the held-out curves make a metric: every run scored at the same versions, at least
    HELDOUT_MIN_VERSIONS of them; with the reason when not."""
    versions = {tuple(r.heldout_versions) for r in runs}
    if len(versions) != 1:
        return False, "the runs were scored at different versions"
    (common,) = versions
    if len(common) < HELDOUT_MIN_VERSIONS:
        return False, f"{len(common)} versions scored, fewer than {HELDOUT_MIN_VERSIONS}"
    return True, f"{len(common)} versions scored ({', '.join(map(str, common))})"


def per_run(run: RunMeasures, primary: str, budget: int, heldout: bool) -> dict[str, float]:
    """Each planned metric of one run, over the first `budget` updates."""
    curve = run.online[:budget]
    values = {
        f"area ({primary})": area(curve, AREA_RULES[primary]),
        "final five": final_mean(curve, min(FINAL_POINTS, len(curve))),
    }
    if heldout:
        values["held-out area"] = area(run.heldout, "trapezoid")
    return values


def analyse(runs: list[RunMeasures], arms: tuple[str, str], primary: str, heldout: bool) -> dict:
    """The paired comparison of arms[1] (treatment) against arms[0] (control) over the seeds both
    have: per run its metrics, per metric the paired summary with t_p and holm_p (Holm over the
    planned metrics)."""
    control, treatment = arms
    by = {(r.arm, r.seed): r for r in runs}
    seeds = sorted(s for a, s in by if a == control and (treatment, s) in by)
    if len(seeds) < 2:
        raise ValueError(
            f"{len(seeds)} complete pairs of {treatment} and {control}: a paired analysis needs two"
        )
    budget = min(len(r.online) for r in runs)
    names = metrics_planned(primary, heldout)
    values = {key: per_run(r, primary, budget, heldout) for key, r in by.items()}
    diffs = {}
    for name in names:
        d = paired([POINTS * (values[(treatment, s)][name] - values[(control, s)][name]) for s in seeds])
        d["t_p"] = t_p(d)
        diffs[name] = d
    for name, adjusted in zip(names, holm([diffs[n]["t_p"] for n in names]), strict=True):
        diffs[name]["holm_p"] = adjusted
    # Each arm's end level (mean of its runs' final five, on [0, 1]): the page's ceiling sentence.
    ends = {arm: sum(values[(arm, s)]["final five"] for s in seeds) / len(seeds) for arm in arms}
    return {
        "arms": {"control": control, "treatment": treatment}, "seeds": seeds, "budget_updates": budget,
        "ends": ends,
        "metrics": names, "primary": names[0],
        "runs": [{"arm": a, "seed": s, **values[(a, s)]} for (a, s) in sorted(values, key=lambda k: (k[1], k[0]))],
        "diffs": diffs,
    }  # fmt: skip
