"""A learner refuses a run whose creation fixed other settings than its own, naming both sides
(services/learner/trainer.py check_run): the recipe, max_staleness and the budget max_updates."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.learner.config import LearnerSettings
from services.learner.trainer import check_run
from spopp.tracker_api import RunConfig


def settings(**over) -> LearnerSettings:
    return LearnerSettings(run="r", model=Path("m"), **{"recipe": "spopp", "max_updates": 30, **over})


def test_the_same_settings_pass_and_a_run_without_a_budget_takes_any():
    check_run(settings(), RunConfig(recipe="spopp", max_updates=30))
    check_run(settings(max_updates=6), RunConfig(recipe="spopp"))  # created before budgets were fixed
    check_run(settings(max_updates=None), RunConfig(recipe="spopp"))


@pytest.mark.parametrize(
    "over,run,named",
    [
        ({"max_updates": 6}, {"max_updates": 30},
         "max_updates: the run's budget is 30 (fixed at its creation; `spopp launch` with more updates grows it), "
         "this learner's 6"),
        ({"max_updates": None}, {"max_updates": 30}, "the run's budget is 30"),
        ({"recipe": "spo"}, {"max_updates": 30}, "recipe: the run is spopp, this learner spo"),
        ({"max_staleness": 1}, {"max_updates": 30}, "max_staleness: the run's is 0, this learner's 1"),
    ],
)  # fmt: skip
def test_each_difference_is_refused_naming_both(over, run, named):
    with pytest.raises(ValueError) as err:
        check_run(settings(**over), RunConfig(recipe="spopp", **run))
    assert "run 'r' does not match this learner's settings" in str(err.value) and named in str(err.value)


def test_every_difference_is_named_at_once():
    with pytest.raises(ValueError) as err:
        check_run(settings(recipe="spo", max_updates=6), RunConfig(recipe="spopp", max_updates=30))
    assert "recipe:" in str(err.value) and "max_updates:" in str(err.value)
