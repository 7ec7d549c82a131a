"""The checks that refuse a comparison which cannot answer, before its main runs are paid for.

SPO++ changes two things (the paper, section 3): the advantage's normalization under the
action-token measure, and prompt evidence kept by policy-event time. Whether either can show
depends on the design, not on the code:

- **headroom**: at version 0 the model must succeed sometimes and fail sometimes (15-70 %): at 5 %
  almost every outcome is a failure and the value barely moves; at 90 % there is little left to
  learn.
- **ceiling**: a pilot whose runs end at or above 0.9 leaves the two arms' curves pressed
  together; a difference then rests on the handful of tasks still failed.
- **outcomes per prompt**: the persistent value is a Beta posterior over each prompt's outcomes;
  with fewer than 8 outcomes per prompt over a run (the paper's prompts see 17-50) it is mostly its
  prior, so the evidence's ordering (event time against receipt order) has nothing to act on.
- **prior**: the paper starts every prompt from 8 offline outcomes; with a flat prior the first
  outcomes of each prompt decide its value alone.

Each check names the setting that moves it. The prior is known from the config and is checked
before the pilot; the others are measured by the pilot, whose runs have the main runs' config.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

V0_BAND = (0.15, 0.70)
CEILING = 0.9
MIN_OUTCOMES_PER_PROMPT = 8.0


@dataclass(frozen=True)
class Check:
    """One design check: its name, whether it passed, what was measured and, when it failed, what
    to change."""

    name: str
    ok: bool
    measured: str
    fix: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        mark = "ok  " if self.ok else "FAIL"
        return f"{mark} {self.name}: {self.measured}" + ("" if self.ok else f" -> {self.fix}")


def prior_check(prior: object) -> Check:
    """The config must name an offline prior (`spopp prior`'s file)."""
    if prior:
        return Check("prior", True, f"offline prior {prior}")
    return Check(
        "prior", False, "no offline prior (prior: unset, a flat Jeffreys prior for every task)",
        "make one from 8 rollouts per prompt with `spopp prior` (as the paper's offline initialization) "
        "and set `prior:` in the config",
    )  # fmt: skip


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _runs(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"


def headroom_check(v0: list[float], where: str) -> Check:
    """Version-0 success, the mean over the pilot's runs, must lie in V0_BAND."""
    mean = _mean(v0)
    lo, hi = V0_BAND
    if mean is None:
        return Check("headroom", False, "no run measured version 0", "run the pilot to its end")
    measured = f"version-0 success {mean:.3f} ({where}, mean of {_runs(len(v0))}; wanted {lo:.2f}-{hi:.2f})"
    if lo <= mean <= hi:
        return Check("headroom", True, measured)
    change = "easier" if mean < lo else "harder"
    return Check(
        "headroom", False, measured,
        f"choose {change} tasks (`tasks:`, or the environment's options in `env_options:`, e.g. reasoning-gym's "
        "`shots` or its dataset's difficulty) or another `model:`",
    )  # fmt: skip


def ceiling_check(last: list[float]) -> Check:
    """The pilot's last point (mean over its runs of their last online reward) must stay below CEILING."""
    mean = _mean(last)
    if mean is None:
        return Check("ceiling", False, "no pilot run finished", "run the pilot to its end")
    measured = f"the pilot's last point {mean:.3f} (mean of {_runs(len(last))}; wanted below {CEILING})"
    if mean < CEILING:
        return Check("ceiling", True, measured)
    return Check(
        "ceiling", False, measured,
        "stop sooner or learn slower: fewer updates (`max_updates`), a lower `learner.lr`, or harder tasks",
    )  # fmt: skip


def outcomes_check(per_prompt: list[float]) -> Check:
    """Outcomes per training prompt, the mean over the pilot's runs, must reach MIN_OUTCOMES_PER_PROMPT."""
    mean = _mean(per_prompt)
    if mean is None:
        return Check(
            "outcomes per prompt", False, "no run recorded the tracker's counts", "run the pilot to its end"
        )
    measured = (
        f"{mean:.2f} outcomes per prompt (mean of {_runs(len(per_prompt))}; wanted at least "
        f"{MIN_OUTCOMES_PER_PROMPT:g}, the paper's prompts see 17-50)"
    )
    if mean >= MIN_OUTCOMES_PER_PROMPT:
        return Check("outcomes per prompt", True, measured)
    return Check(
        "outcomes per prompt", False, measured + ": the persistent value does not engage",
        "train on fewer prompts (a smaller `tasks:` file) or for longer (`max_updates`, `learner.batch_size`)",
    )  # fmt: skip


def failed(checks: list[Check]) -> list[Check]:
    return [c for c in checks if not c.ok]
