"""The run's terms a learner adopts: what the tracker's run fixed at its creation, read from there.

The recipe, the staleness bound k and the budget are the run's (`PUT /v1/runs/{run}` sets them
once; only `POST .../budget` grows the budget), so a learner reads them from the tracker at start
rather than from a second copy in its own settings. A learner may still be given them (a compose
stack's settings file does): then they must be the run's, and a difference is refused naming both
sides, so that a learner restarted with other settings never trains the run to another budget or
rule. Normalization and Dual-Clip not given follow the run's recipe (spopp/settings/recipes.py), so that a
learner given nothing but its run trains that run's recipe.
"""

from __future__ import annotations

from services.config.learner import LearnerSettings
from spopp.api.tracker_api import RunConfig
from spopp.settings.recipes import RECIPE_DEFAULTS


def check_run(cfg: LearnerSettings, run: RunConfig) -> None:
    """ValueError naming both sides of every setting given to this learner that its run fixed
    otherwise; what is not given is not checked (it is taken from the run)."""
    wrong = []
    if cfg.recipe is not None and run.recipe != cfg.recipe:
        wrong.append(f"recipe: the run is {run.recipe}, this learner {cfg.recipe}")
    if cfg.max_staleness is not None and run.max_staleness != cfg.max_staleness:
        wrong.append(f"max_staleness: the run's is {run.max_staleness}, this learner's {cfg.max_staleness}")
    if cfg.max_updates is not None and run.max_updates is not None and run.max_updates != cfg.max_updates:
        wrong.append(
            f"max_updates: the run's budget is {run.max_updates} (fixed at its creation; `spopp launch` with more "
            f"updates grows it), this learner's {cfg.max_updates}"
        )
    if wrong:
        raise ValueError(f"run {cfg.run!r} does not match this learner's settings: " + "; ".join(wrong))


def adopt_run_terms(cfg: LearnerSettings, run: RunConfig) -> LearnerSettings:
    """`cfg` with the run's recipe, max_staleness and budget where it gives none, and the recipe's
    normalization and Dual-Clip where it gives none (check_run's ValueError first)."""
    check_run(cfg, run)
    fill: dict = {}
    if cfg.recipe is None:
        fill["recipe"] = run.recipe
    if cfg.max_staleness is None:
        fill["max_staleness"] = run.max_staleness
    if cfg.max_updates is None and run.max_updates is not None:
        fill["max_updates"] = run.max_updates
    for field, value in RECIPE_DEFAULTS[fill.get("recipe", cfg.recipe)].items():
        if field not in cfg.model_fields_set:
            fill[field] = value
    return cfg.model_copy(update=fill)
