"""What `spopp study compare` reads off one finished run folder: its online training-reward curve
(the paper's primary curve: the mean reward of each update's batch, first-completed trajectories,
from learner/metrics.jsonl), its held-out curve (the evaluator's evals.jsonl), how many outcomes
each training prompt got (the tracker's counts in run.json), its success at version 0, and its
wall time and where it went.

Every reader raises StudyDataError naming the file and what is wrong, so that a study never
computes a number from a run it could not read whole.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from spopp.files.records import RunRecord
from spopp.files.runs import EVALS_FILE, LEARNER_FILE, RUN_FILE, RunError, read_run

HELDOUT_METRIC = "eval/sampled/reward_mean"


class StudyDataError(ValueError):
    """A run folder lacks what the study reads, or holds something it cannot use."""


@dataclass(frozen=True)
class RunMeasures:
    """One run as the study sees it."""

    folder: Path
    arm: str
    seed: int
    online: list[float]  # reward_mean of update 1, 2, ... (update t trains on version t - 1's batch)
    heldout: list[float]  # held-out success per evaluated version, in version order
    heldout_versions: list[int]
    outcomes_per_prompt: float | None
    seconds: float | None
    time_parts: dict[str, float]
    code: dict | None
    protocol: str | None

    @property
    def v0_success(self) -> tuple[float, str]:
        """Success of version 0 and where it was read: the evaluator's version 0 when it scored it
        (held-out tasks, every episode counted), else the first update's batch (training tasks,
        first-completed: biased toward whichever outcome ends sooner)."""
        if self.heldout_versions and self.heldout_versions[0] == 0:
            return self.heldout[0], "held-out"
        return self.online[0], "first training batch"


def online_curve(folder: Path) -> list[float]:
    """reward_mean of every update, in step order; StudyDataError when the file is missing, a
    line does not parse, a step repeats or is missing, or a reward is not a finite number."""
    path = folder / LEARNER_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise StudyDataError(f"{path}: cannot read the learner's metrics ({exc})") from None
    by_step: dict[int, float] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step, reward = int(record["step"]), float(record["reward_mean"])
        except (ValueError, KeyError, TypeError):
            raise StudyDataError(f"{path}:{n}: not a learner update with a step and a reward_mean") from None
        if not math.isfinite(reward) or step in by_step:
            raise StudyDataError(f"{path}:{n}: step {step} repeated or its reward_mean is not finite")
        by_step[step] = reward
    steps = sorted(by_step)
    if not steps or steps != list(range(1, len(steps) + 1)):
        raise StudyDataError(f"{path}: the updates must run 1, 2, ... without a gap; found {steps[:8]}")
    return [by_step[s] for s in steps]


# Where a run's wall time goes, from the learner's own records (spopp.files.runs sums the same parts):
# its updates, its waits for a batch (generation behind), publishing and checkpoints; the rest of
# the run's wall time is starting and stopping the processes and the evaluator's last versions.
TIME_PARTS = {"update_seconds": "updates", "batch_wait_s": "waiting for batches", "publish_s": "publishing",
              "checkpoint_s": "checkpoints"}  # fmt: skip


def time_parts(folder: Path, wall: float | None) -> dict[str, float]:
    """Seconds of each of TIME_PARTS over the run's updates, and `other` (wall time less them, when
    the wall time is known); {} without the learner's file."""
    try:
        lines = (folder / LEARNER_FILE).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    parts = dict.fromkeys(TIME_PARTS.values(), 0.0)
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        for key, name in TIME_PARTS.items():
            value = record.get(key) if isinstance(record, dict) else None
            if isinstance(value, int | float) and math.isfinite(value):
                parts[name] += float(value)
    if wall is not None:
        parts["other"] = max(0.0, wall - math.fsum(parts.values()))
    return parts


def measure(folder: Path) -> RunMeasures:
    """Everything the study reads of one run folder (StudyDataError naming what is missing)."""
    path = folder / RUN_FILE
    try:
        record = RunRecord.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StudyDataError(f"{path}: cannot read the run's record ({str(exc).splitlines()[0]})") from None
    heldout, versions = [], []
    if (folder / EVALS_FILE).is_file():
        warnings: list[str] = []
        try:
            run = read_run(folder, HELDOUT_METRIC, warnings)
        except RunError as exc:
            raise StudyDataError(str(exc)) from None
        heldout, versions = run.rewards, run.versions
    counts = record.tracker_counts or {}
    per_prompt = (
        counts["outcomes"] / counts["tasks"] if counts.get("tasks") and "outcomes" in counts else None
    )
    seconds = record.seconds if record.finished else None
    return RunMeasures(
        folder=folder, arm=record.arm, seed=record.seed, online=online_curve(folder), heldout=heldout,
        heldout_versions=versions, outcomes_per_prompt=per_prompt, seconds=seconds,
        time_parts=time_parts(folder, seconds), code=record.code,
        protocol=record.protocol,
    )  # fmt: skip
