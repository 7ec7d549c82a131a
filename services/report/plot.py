"""`curves.png`, in the style of the paper's Figure 1: evaluation reward against policy version.

Per arm: a thin line for each replicate, a thick line for the mean over replicates and a band of
± one standard error, all on curves smoothed by a five-point trailing mean. Replicates need not be
scored at the same versions (a skipped snapshot leaves a gap), so the mean is taken on the union
of their versions within the range every replicate covers, each interpolated between its points.
matplotlib is imported here only, and on the Agg backend through the object API (no pyplot, no
display), so that `spopp --help` stays instant and the report runs on headless machines.
"""

from __future__ import annotations

import math
from pathlib import Path

from spopp.files.runs import Run

from .tables import EVENTTIME, SPO, SPOPP, TRAJNORM, arm_name

SMOOTHING = 5
COLORS = {SPO: "#1f77b4", SPOPP: "#d62728", TRAJNORM: "#2ca02c", EVENTTIME: "#ff7f0e"}
OTHER_COLORS = ("#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
ARM_ORDER = (SPO, SPOPP, TRAJNORM, EVENTTIME)


def trailing_mean(values: list[float], window: int = 5) -> list[float]:
    """Each point replaced by the mean of itself and up to window - 1 points before it (the figure's smoothing)."""
    if window < 1:
        raise ValueError(f"window must be positive, got {window}")
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(math.fsum(chunk) / len(chunk))
    return out


def interpolate(xs: list[float], ys: list[float], x: float) -> float | None:
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


def mean_band(curves: list[tuple[list[float], list[float]]]) -> tuple[list[float], list[float], list[float]]:
    """(x, mean, standard error) of replicate curves, on the versions where every replicate has a value.

    x is the union of the replicates' versions inside their common range; each replicate is
    interpolated linearly between its own points. Past the shortest replicate the mean would be
    taken over fewer and fewer runs and jump with whichever is left, so it stops there (the thin
    lines go on), as the tables cut each pair to its common length.
    """
    lo = max(xs[0] for xs, _ys in curves)
    hi = min(xs[-1] for xs, _ys in curves)
    grid = sorted({x for xs, _ys in curves for x in xs if lo <= x <= hi})
    means, errors = [], []
    for x in grid:
        values = [v for xs, ys in curves if (v := interpolate(xs, ys, x)) is not None]
        mean = math.fsum(values) / len(values)
        means.append(mean)
        if len(values) > 1:
            sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))
            errors.append(sd / math.sqrt(len(values)))
        else:
            errors.append(0.0)  # a single replicate: no spread to show
    return grid, means, errors


def _xs(run: Run, x: str) -> list[float]:
    if x == "version":
        return [float(v) for v in run.versions]
    if any(s is None for s in run.seconds):
        raise ValueError(
            f"run {run.label}: --x time needs the learner's metrics.jsonl with each scored version's "
            "publication; it is missing or incomplete"
        )
    return [s / 60.0 for s in run.seconds]


def draw(runs: list[Run], path: Path, title: str, metric: str, x: str = "version") -> None:
    """Write the figure of every run (paired or not) to `path` as a PNG; `x` is "version" or
    "time" (minutes from the learner's start to each version's publication)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    arms = sorted({run.arm for run in runs}, key=lambda a: (ARM_ORDER.index(a) if a in ARM_ORDER else 99, a))
    fig = Figure(figsize=(7.5, 4.5), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    others = iter(OTHER_COLORS * (1 + len(arms) // len(OTHER_COLORS)))
    for arm in arms:
        color = COLORS.get(arm) or next(others)
        replicates = [r for r in runs if r.arm == arm]
        curves = [(_xs(r, x), trailing_mean(r.rewards, SMOOTHING)) for r in replicates]
        for xs, ys in curves:
            ax.plot(xs, ys, color=color, linewidth=0.8, alpha=0.35)
        grid, means, errors = mean_band(curves)
        if len(replicates) > 1:
            ax.fill_between(
                grid,
                [m - e for m, e in zip(means, errors, strict=True)],
                [m + e for m, e in zip(means, errors, strict=True)],
                color=color,
                alpha=0.18,
                linewidth=0,
            )
        ax.plot(grid, means, color=color, linewidth=2.2, label=f"{arm_name(arm)} (n={len(replicates)})")
    ax.set_xlabel("policy version" if x == "version" else "wall-clock minutes since the learner started")
    ax.set_ylabel(f"evaluation reward ({metric})")
    ax.set_title(title, fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend(
        title=f"mean ± 1 s.e.; thin: replicates; {SMOOTHING}-point trailing mean",
        title_fontsize=8,
        fontsize=8,
        loc="best",
    )
    fig.tight_layout()
    fig.savefig(path, format="png")
