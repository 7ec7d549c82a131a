"""A learner bound to its run (services/learner/run_terms.py): the recipe, max_staleness and the
budget max_updates are the tracker run's, read at start; given to the learner as well, they must
be the run's, and a difference is refused naming both sides."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config.learner import LearnerSettings
from services.learner.run_terms import adopt_run_terms, check_run
from spopp.api.tracker_api import RunConfig


def settings(**over) -> LearnerSettings:
    return LearnerSettings(run="r", model=Path("m"), **{"recipe": "spopp", "max_updates": 30, **over})


def test_what_is_not_given_is_the_runs():
    bare = LearnerSettings(run="r", model=Path("m"))
    got = adopt_run_terms(bare, RunConfig(recipe="spo", max_staleness=1, max_updates=12))
    assert (got.recipe, got.max_staleness, got.max_updates) == ("spo", 1, 12)
    # The recipe's normalization and Dual-Clip, since none was given: SPO's full recipe.
    assert (got.normalization, got.dual_clip) == ("trajectory", 10.0)
    got = adopt_run_terms(bare, RunConfig(recipe="spopp"))
    assert (got.recipe, got.max_staleness, got.max_updates) == ("spopp", 0, None)  # no budget: never stop
    assert (got.normalization, got.dual_clip) == ("token", 2.0)
    # Given, they stay: an arm that changes one thing (spo-eventtime: SPO++'s evidence, SPO's learner).
    arm = LearnerSettings(run="r", model=Path("m"), normalization="trajectory", dual_clip=10.0)
    got = adopt_run_terms(arm, RunConfig(recipe="spopp"))
    assert (got.recipe, got.normalization, got.dual_clip) == ("spopp", "trajectory", 10.0)
    # dual_clip given as null (off) is given: it stays off.
    off = LearnerSettings.resolve(env={}, flags={"run": "r", "model": "m", "dual_clip": None})
    assert adopt_run_terms(off, RunConfig(recipe="spo")).dual_clip is None
    assert bare.recipe is None  # bind answers a copy


def test_the_same_settings_pass_and_a_run_without_a_budget_takes_any():
    assert adopt_run_terms(settings(), RunConfig(recipe="spopp", max_updates=30)).max_updates == 30
    assert (
        adopt_run_terms(settings(max_updates=6), RunConfig(recipe="spopp")).max_updates == 6
    )  # created before budgets
    check_run(settings(max_updates=None), RunConfig(recipe="spopp"))


@pytest.mark.parametrize(
    "over,run,named",
    [
        ({"max_updates": 6}, {"max_updates": 30},
         "max_updates: the run's budget is 30 (fixed at its creation; `spopp launch` with more updates grows it), "
         "this learner's 6"),
        ({"recipe": "spo"}, {"max_updates": 30}, "recipe: the run is spopp, this learner spo"),
        ({"max_staleness": 1}, {"max_updates": 30}, "max_staleness: the run's is 0, this learner's 1"),
    ],
)  # fmt: skip
def test_each_difference_is_refused_naming_both(over, run, named):
    with pytest.raises(ValueError) as err:
        adopt_run_terms(settings(**over), RunConfig(recipe="spopp", **run))
    assert "run 'r' does not match this learner's settings" in str(err.value) and named in str(err.value)


def test_every_difference_is_named_at_once():
    with pytest.raises(ValueError) as err:
        check_run(settings(recipe="spo", max_updates=6), RunConfig(recipe="spopp", max_updates=30))
    assert "recipe:" in str(err.value) and "max_updates:" in str(err.value)
