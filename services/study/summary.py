"""map.json's content from a map's run folders: per cell and arm the per-seed areas, the paired
differences of the chain's steps and of SPO++ against SPO (each with its t interval and sign test),
and what each knob measurably did.

A step of the chain is one change alone (spopp/compare/arms.py): spo → spo-eventtime is event-time evidence,
spo-eventtime → spopp-trajnorm Dual-Clip 2, spopp-trajnorm → spopp the action-token measure. Of
the arms a map has, each step pairs one arm with the one before it in the chain; with two or more
steps the total (SPO++ − SPO) is reported beside them.

Over the cells (across_cells): each difference's two-sided t test p, Holm's adjustment of it over
the cells that make the same comparison (a map tests each comparison once per cell, so a reader
looking for the cell where it "works" has as many chances as cells), and per comparison Fisher's
combination of the cells' p's, the test of "no difference in any cell" (the tests are the
library's, spopp.compare.stats).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from spopp.compare.arms import ARMS, step_label
from spopp.compare.stats import fisher, holm, paired, t_p
from spopp.files import provenance
from spopp.files.records import RunRecord
from spopp.files.runs import read_run
from spopp.metrics import POINTS, area, c10

MEASURES = (
    "length_advantage_corr",
    "batch_reward",
    "late_fraction",
    "overtaken_fraction",
    "reorder_distance",
)
TOTAL = ("spopp", "spo")


def diff_key(arm: str, against: str) -> str:
    return f"{arm} vs {against}"


def pairs(arms: list[str]) -> list[tuple[str, str]]:
    """(arm, against) of every paired difference a map of `arms` reports: each step of the chain
    between the arms present (in the chain's order), then SPO++ − SPO when it is not one of them."""
    chain = [a for a in ARMS if a in arms]
    out = list(zip(chain[1:], chain[:-1], strict=True))
    if TOTAL not in out and all(a in arms for a in TOTAL):
        out.append(TOTAL)
    return out


def _mean(xs: list[float]) -> float | None:
    return math.fsum(xs) / len(xs) if xs else None


def run_dir(out: Path, cell: str, arm: str, seed: int) -> Path:
    return out / "cells" / cell / "runs" / f"{arm}-s{seed}"


def measured(folder: Path) -> dict[str, float | None]:
    """What the knobs did in one run: mean length-advantage correlation over its updates; the mean
    reward of its training batches (first-completed: below the held-out reward where successes are
    the slower episodes); the share of its outcomes reported after a newer policy was published
    (late), and after the outcome of a request dispatched later (overtaken: out of dispatch order),
    and how many dispatches the newest reported request was past each outcome (distance)."""
    corr, batch_reward = [], []
    try:
        for line in (folder / "learner" / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if "length_advantage_corr" in record:
                corr.append(float(record["length_advantage_corr"]))
            if "reward_mean" in record:
                batch_reward.append(float(record["reward_mean"]))
    except (OSError, ValueError):
        pass
    late = overtaken = distance = None
    try:
        counts = RunRecord.model_validate_json((folder / "run.json").read_text()).tracker_counts or {}
        if counts.get("outcomes"):
            late = counts.get("late_outcomes", 0) / counts["outcomes"]
            overtaken = counts.get("overtaken_outcomes", 0) / counts["outcomes"]
            distance = counts.get("reorder_distance", 0) / counts["outcomes"]
    except (OSError, ValueError):
        pass
    return {
        "length_advantage_corr": _mean(corr), "batch_reward": _mean(batch_reward), "late_fraction": late,
        "overtaken_fraction": overtaken, "reorder_distance": distance,
    }  # fmt: skip


def env_options(folder: Path) -> dict | None:
    """Every environment option one run had: run.json's env_options, or for a run launched before
    they were written there, its identity's (as given) with the environment's defaults filled in;
    None without a readable run.json."""
    from runtime.envs import resolved_env_options

    try:
        record = RunRecord.model_validate_json((folder / "run.json").read_text())
    except (OSError, ValueError):
        return None
    if record.env_options is not None:
        return record.env_options
    env = record.env or record.identity.get("env")
    if env is None:
        return None
    try:
        return resolved_env_options(env, record.identity.get("env_options"))
    except ValueError:  # an environment this version does not know
        return None


def run_times(out: Path) -> dict[str, float | int | None]:
    """The finished runs under `out`: how many, their mean and total wall seconds, and the span from
    the first start to the last finish (epoch seconds), from their run.json."""
    spans = []
    for path in (out / "cells").glob("*/runs/*/run.json"):
        try:
            record = RunRecord.model_validate_json(path.read_text())
        except (OSError, ValueError):
            continue
        if record.status == "finished" and record.started and record.finished:
            spans.append((record.started, record.finished, record.seconds))
    seconds = [s for _a, _b, s in spans]
    return {
        "runs": len(spans), "mean_s": _mean(seconds), "total_s": math.fsum(seconds),
        "first_start": min((a for a, _b, _s in spans), default=None),
        "last_finish": max((b for _a, b, _s in spans), default=None),
    }  # fmt: skip


def _common(options: list[dict | None], warnings: list[str]) -> dict | None:
    """The environment options a cell's runs share (None when no run says); a warning when they
    differ, which a cell of one base config never should."""
    known = [o for o in options if o is not None]
    if not known:
        return None
    if any(o != known[0] for o in known[1:]):
        warnings.append("the runs of this cell ran with different env_options: " + "; ".join(
            sorted({json.dumps(o, sort_keys=True) for o in known})))  # fmt: skip
        return None
    return known[0]


def _means(runs: list[dict]) -> dict[str, float | None]:
    """Each measure's mean over the runs that have it (None where none does)."""
    return {key: _mean([m[key] for m in runs if m[key] is not None]) for key in MEASURES}


def summarize_cell(
    out: Path, name: str, arms: list[str], seeds: list[int], order, mixed_code: str = "refuse"
) -> dict:
    """One cell over its seeds: per arm the per-seed areas (and their mean, C10 and measures), each
    paired difference in area points, the environment options its runs had, warnings, and the code
    of its runs (spopp.files.provenance: runs from different code are refused, or flagged by `mixed_code`)."""
    warnings: list[str] = []
    curves: dict[str, dict[int, list[float]]] = {arm: {} for arm in arms}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    options: list[dict | None] = []
    codes: dict[str, dict | None] = {}
    for arm in arms:
        for seed in seeds:
            folder = run_dir(out, name, arm, seed)
            run = read_run(folder, "eval/sampled/reward_mean", warnings)
            curves[arm][seed], codes[folder.name] = run.rewards, run.code
            runs[arm].append(measured(folder))
            options.append(env_options(folder))
    points = min(len(c) for by_seed in curves.values() for c in by_seed.values())
    areas = {arm: {s: area(curves[arm][s][:points]) for s in seeds} for arm in arms}
    per_arm = {
        arm: {
            "area": _mean(list(areas[arm].values())), "per_seed": {str(s): areas[arm][s] for s in seeds},
            "c10": _mean([c10(curves[arm][s][:points]) for s in seeds]), **_means(runs[arm]),
        }
        for arm in arms
    }  # fmt: skip
    diffs = {
        diff_key(a, b): {
            "arm": a, "against": b, "label": step_label(a, b),
            **paired([POINTS * (areas[a][s] - areas[b][s]) for s in seeds]),
        }
        for a, b in pairs(arms)
    }  # fmt: skip
    return {
        "seeds": seeds, "points": points, "env_options": _common(options, warnings),
        "arm_order": {str(seed): order(arms, i) for i, seed in enumerate(seeds)},
        "start": _mean([curves[arm][s][0] for arm in arms for s in seeds if curves[arm][s]]),
        "arms": per_arm, "diffs": diffs, "warnings": warnings,
        "measured": _means([m for arm in arms for m in runs[arm]]),
        "code": provenance.check(codes, mixed_code, f"cell {name} of {out}"),
    }  # fmt: skip


def across_cells(cells: list[dict]) -> dict[str, dict]:
    """The tests over a map's cells. Each cell's paired differences get their t test's p (t_p) and
    Holm's adjustment of it over the cells that have the same comparison (holm_p); answers, per
    comparison, Fisher's combination of the cells' t_p with the comparison's label."""
    keys = list(dict.fromkeys(k for c in cells for k in c["diffs"]))
    pooled = {}
    for key in keys:
        diffs = [c["diffs"][key] for c in cells if key in c["diffs"]]
        ps = [t_p(d) for d in diffs]
        for d, p, adjusted in zip(diffs, ps, holm(ps), strict=True):
            d["t_p"], d["holm_p"] = p, adjusted
        pooled[key] = {"label": diffs[0]["label"], "test": "fisher", **fisher(ps)}
    return pooled
