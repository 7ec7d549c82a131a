"""What common random numbers buy a paired comparison on the toy (docs/results/crn/protocol.json).

The same cell, arms and seeds twice: BEFORE, the committed map's runs, whose draws were keyed on
each run's name (so the two arms of a seed dispatched different prompts from the first batch on);
AFTER, the same settings run again with the draws keyed on (seed, study) (spopp.compare.streams). For each:

- first batch: each arm's first training batch's mean reward (learner/metrics.jsonl, step 1) and
  whether the two arms' are equal, seed by seed;
- the area of each run (100 x the trapezoid area of its held-out curve, as the map's);
- the arm-to-arm Pearson correlation over seeds of the areas (of the seed deviations): what
  pairing by seed can remove from the variance of a difference is 2 r s_a s_b;
- the paired s.d. over seeds of Δ area (second arm − first): the s.e. of the mean Δ is it / sqrt(n).

    python -m tools.crn_measure --before docs/map/data --after docs/results/crn/data \
        --out docs/results/crn/crn.json          # measure, write the JSON, print the table
    python -m tools.crn_measure --render docs/results/crn/crn.json   # the table from the JSON alone
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from services.study.summary import run_dir
from spopp.files.runs import read_run
from spopp.metrics import POINTS, area

METRIC = "eval/sampled/reward_mean"


def first_batch_reward(folder: Path) -> float:
    """The mean reward of the run's first training batch (its first learner update)."""
    for line in (folder / "learner" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("step") == 1:
            return float(row["reward_mean"])
    raise ValueError(f"{folder}: no step 1 in learner/metrics.jsonl")


def measure_side(root: Path, cell: str, arms: list[str], seeds: list[int]) -> dict:
    """One side (before or after): per arm and seed the area and first-batch reward, then the
    correlation of the arms' areas over seeds and the paired s.d. of their difference."""
    first, second = arms
    warnings: list[str] = []
    areas: dict[str, list[float]] = {}
    batches: dict[str, list[float]] = {}
    for arm in arms:
        areas[arm], batches[arm] = [], []
        for seed in seeds:
            folder = run_dir(root, cell, arm, seed)
            run = read_run(folder, METRIC, warnings)
            areas[arm].append(POINTS * area(run.rewards))
            batches[arm].append(first_batch_reward(folder))
    deltas = [b - a for a, b in zip(areas[first], areas[second], strict=True)]
    return {
        "areas": areas,
        "first_batch_reward": batches,
        "first_batch_equal": sum(x == y for x, y in zip(batches[first], batches[second], strict=True)),
        "correlation": statistics.correlation(areas[first], areas[second]),
        "sd": {arm: statistics.stdev(areas[arm]) for arm in arms},
        "delta_mean": statistics.fmean(deltas),
        "delta_sd": statistics.stdev(deltas),
        "delta_se": statistics.stdev(deltas) / len(deltas) ** 0.5,
        "warnings": warnings,
    }


def measure(before: Path, after: Path, protocol: dict, after_commit: str | None = None) -> dict:
    cell, arms, seeds = protocol["cell"], protocol["arms"], protocol["seeds"]
    return {
        # The commit whoever ran the after runs names for them: their run.json predates provenance
        # (records no code), so no record confirms it, and the page says so.
        "after_commit": after_commit,
        "cell": cell,
        "arms": arms,
        "seeds": seeds,
        "before": measure_side(before, cell, arms, seeds),
        "after": measure_side(after, cell, arms, seeds),
    }


def render(result: dict) -> str:
    """The table docs/results.md shows, from the JSON alone."""
    first, second = result["arms"]
    n = len(result["seeds"])
    rows = [
        f"| draws keyed on | first batches equal | r (areas, {first} vs {second}) | s.d. {first} | "
        f"s.d. {second} | Δ area ({second} − {first}) ± s.e. | paired s.d. of Δ |",
        "|---|---|---|---|---|---|---|",
    ]
    for side, label in (("before", "run name (the map's runs)"), ("after", "seed and study")):
        s = result[side]
        rows.append(
            f"| {label} | {s['first_batch_equal']} of {n} | {s['correlation']:+.2f} | {s['sd'][first]:.2f} | "
            f"{s['sd'][second]:.2f} | {s['delta_mean']:+.2f} ± {s['delta_se']:.2f} | {s['delta_sd']:.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, help="the map's folder (cells/<cell>/runs/<arm>-s<seed>)")
    p.add_argument("--after", type=Path, help="the common-random-numbers runs' folder, laid out alike")
    p.add_argument("--protocol", type=Path, default=Path("docs/results/crn/protocol.json"))
    p.add_argument("--out", type=Path, help="write the measurement here as JSON")
    p.add_argument(
        "--after-commit", help="the commit the after runs were made by, as their maker names it (unchecked)"
    )
    p.add_argument("--render", type=Path, help="print the table of a measurement JSON and exit")
    a = p.parse_args(argv)
    if a.render:
        print(render(json.loads(a.render.read_text())))
        return 0
    if not (a.before and a.after):
        p.error("--before and --after are needed (or --render)")
    result = measure(a.before, a.after, json.loads(a.protocol.read_text()), a.after_commit)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
