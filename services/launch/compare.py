"""Matched runs: one base config, several arms, several seeds, then `spopp report` over them.

An arm changes the recipe and nothing else (the paper's protocol: same checkpoint, tasks, prior,
decoding, budget and optimizer):

    spo             recipe spo: drift retention, trajectory normalization, Dual-Clip 10
    spopp           recipe spopp: event-time evidence, action-token normalization, Dual-Clip 2
    spopp-trajnorm  SPO++ with trajectory normalization (Table 2's middle arm)

Any arm with a `-k<N>` suffix (spopp-k1, spo-k2) is that arm under bounded staleness
max_staleness N; without one, an arm keeps the base config's max_staleness. `--arms spopp,spopp-k1`
pairs the paper's protocol against one version of staleness on the same seeds.

Runs go one after another (each uses the whole machine) into `<out>/runs/<arm>-s<seed>/`, and
the report (report.json, report.md, curves.png) into `<out>`; an
interrupted comparison resumes where it stopped, since each finished run says so and each
unfinished one resumes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from .config import LaunchSettings

ARMS: dict[str, dict[str, Any]] = {
    "spo": {"recipe": "spo", "learner": {}},
    "spopp": {"recipe": "spopp", "learner": {}},
    "spopp-trajnorm": {"recipe": "spopp", "learner": {"normalization": "trajectory"}},
}
# Set per arm: a base config that fixed them would make every arm the same recipe.
ARM_FIELDS = ("normalization", "dual_clip")


def parse_arm(arm: str) -> tuple[str, int | None]:
    """(the recipe arm, its max_staleness or None for the base config's) of e.g. spopp-k1."""
    recipe, sep, k = arm.rpartition("-k")
    if sep and recipe in ARMS and k.isdigit():
        return recipe, int(k)
    if arm not in ARMS:
        raise ValueError(
            f"unknown arm {arm!r}: choose from {', '.join(ARMS)}, each optionally with -k<N> "
            "(max_staleness N), e.g. spopp-k1"
        )
    return arm, None


def arm_settings(base: LaunchSettings, arm: str, seed: int, out: Path) -> LaunchSettings:
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
    values.update(recipe=spec["recipe"], seed=seed, run=name, run_dir=out / "runs" / name)
    if staleness is not None:
        values["max_staleness"] = staleness
    values["learner"] = {**base.learner.model_dump(), **spec["learner"]}  # the section as given
    return LaunchSettings.model_validate(values)


def compare(base: LaunchSettings, arms: list[str], seeds: list[int], out: Path, echo=print,
            report_args: tuple[str, ...] = ()) -> int:  # fmt: skip
    """Run every (seed, arm), then report; answers the exit code."""
    from .run import Launcher, LaunchError

    planned = [arm_settings(base, arm, seed, out) for seed in seeds for arm in arms]
    launchers = []
    for s in planned:  # every run is checked before the first one starts
        launcher = Launcher(s, echo=echo)
        try:
            launcher.prepare()
        except LaunchError as exc:
            raise LaunchError(f"{s.run}: {exc}") from None
        launchers.append(launcher)
    for n, launcher in enumerate(launchers, 1):
        echo(f"=== run {n}/{len(launchers)}: {launcher.s.run}")
        code = launcher.run()
        if code != 0:
            echo(
                f"{launcher.s.run} ended with code {code}; the comparison stops here (launch it again to resume)"
            )
            return code
    # Exactly these runs: the folder may hold runs of other seeds from an earlier comparison.
    dirs = [str(launcher.s.run_dir) for launcher in launchers]
    args = [sys.executable, "-m", "services.cli", "report", *dirs, "--out", str(out), *report_args]
    return subprocess.run(args).returncode
