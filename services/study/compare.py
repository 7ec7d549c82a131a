"""Matched runs: one base config, several arms, several seeds, then `spopp report` over them.

An arm changes the recipe and nothing else (the paper's protocol: same checkpoint, tasks, prior,
decoding, budget and optimizer); the arms are in spopp/compare/arms.py. `--arms spopp,spopp-k1` pairs the paper's
protocol against one version of staleness on the same seeds. The arms of one seed share a study
(the comparison's folder name unless the base config names one), so they draw the same prompts,
samples and environment streams: the pair differs by its method only (spopp.compare.streams).

Runs go one after another (each uses the whole machine) into `<out>/runs/<arm>-s<seed>/`, and
the report (report.json, report.md, curves.png) into `<out>`; an
interrupted comparison resumes where it stopped, since each finished run says so and each
unfinished one resumes.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from services.config.launch import LaunchSettings
from spopp.compare.arms import ARM_FIELDS, ARMS, parse_arm


def arm_settings(
    base: LaunchSettings, arm: str, seed: int, out: Path, protocol: str | None = None
) -> LaunchSettings:
    recipe_arm, staleness = parse_arm(arm)
    fixed = [k for k in ARM_FIELDS if k in base.learner]
    if fixed:
        raise ValueError(
            f"learner.{', learner.'.join(fixed)} is set in the base config, but each arm sets it (its "
            "recipe's value): remove it to compare recipes"
        )
    spec = ARMS[recipe_arm]
    name = f"{arm}-s{seed}"
    values = base.model_dump(exclude={"run", "run_dir"})
    # Every arm of one seed draws the same prompts, samples and environment streams (spopp.compare.streams):
    # the study is the comparison's folder (a map's cell), so pairs pair and comparisons stay apart.
    study = base.study or (re.sub(r"[^A-Za-z0-9_.:@+=-]", "_", out.resolve().name)[:128] or "study")
    values.update(recipe=spec["recipe"], seed=seed, study=study, run=name, run_dir=out / "runs" / name)
    if staleness is not None:
        values["max_staleness"] = staleness
    if protocol is not None:  # spopp study compare's pre-registration (services/study/registration.py)
        values["protocol"] = protocol
    values["learner"] = {**base.learner.model_dump(), **spec["learner"]}  # the section as given
    return LaunchSettings.model_validate(values)


def run_in_turn(planned: list[tuple[str, LaunchSettings]], echo, what: str) -> tuple[list, int]:
    """Check every run (`(label, settings)`) before the first starts, then run them one after
    another, each with a progress line and an estimate of the time left; a run already finished
    is said so and skipped. Stops at the first run that fails; answers (the launchers, exit code)."""
    from services.launch.run import Launcher, LaunchError

    launchers = []
    for label, s in planned:
        launcher = Launcher(s, echo=echo)
        try:
            launcher.prepare()
        except LaunchError as exc:
            raise LaunchError(f"{label + ' ' if label else ''}{s.run}: {exc}") from None
        launchers.append(launcher)
    t0, ran = time.monotonic(), 0
    for n, ((label, _s), launcher) in enumerate(zip(planned, launchers, strict=True), 1):
        done = launcher.finished_already()
        left = ""
        if ran and not done:
            left = f", about {(time.monotonic() - t0) / ran * (len(launchers) - n + 1) / 60:.0f} min left"
        name = f"{label + ' ' if label else ''}{launcher.s.run}"
        echo(f"=== {what} run {n}/{len(launchers)}: {name}" + (" (finished)" if done else left))
        if done:
            continue
        code = launcher.run()
        ran += 1
        if code != 0:
            echo(f"{launcher.s.run} ended with code {code}; the {what} stops here (run it again to resume)")
            return launchers, code
    return launchers, 0


def compare(base: LaunchSettings, arms: list[str], seeds: list[int], out: Path, echo=print,
            report_args: tuple[str, ...] = ()) -> int:  # fmt: skip
    """Run every (seed, arm), then report; answers the exit code."""

    planned = [("", arm_settings(base, arm, seed, out)) for seed in seeds for arm in arms]
    launchers, code = run_in_turn(planned, echo, "comparison")
    if code != 0:
        return code
    # Exactly these runs: the folder may hold runs of other seeds from an earlier comparison.
    dirs = [str(launcher.s.run_dir) for launcher in launchers]
    args = [sys.executable, "-m", "services.cli", "report", *dirs, "--out", str(out), *report_args]
    return subprocess.run(args).returncode
