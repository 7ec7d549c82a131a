"""The comparison arms: each changes the recipe and nothing else, one change at a time.

SPO++ differs from SPO in three places (paper §3-§5): the prompt tracker (values frozen at dispatch,
outcomes kept by policy-event coordinate with fixed retention 0.875, where SPO updates in receipt
order with drift-dependent retention), Dual-Clip (c = 2 instead of 10) and the normalization measure
(action tokens instead of one scalar per trajectory). The arms walk from SPO to SPO++ adding one
change each, so that every step's paired difference is one change alone:

    spo             recipe spo: drift retention, trajectory normalization, Dual-Clip 10
    spo-eventtime   + event-time evidence (recipe spopp's tracker), trajectory normalization, Dual-Clip 10
    spopp-trajnorm  + Dual-Clip 2: SPO++ with trajectory normalization (the paper's Table 2 arm)
    spopp           + the action-token measure: recipe spopp in full

Any arm with a `-k<N>` suffix (spopp-k1, spo-k2) is that arm under bounded staleness
max_staleness N; without one, an arm keeps the base config's max_staleness.

The launcher names each run's arm by them (`arm_of`, into run.json) and the studies
(services/study) compose their comparisons of them, so they live in the library.
"""

from __future__ import annotations

from typing import Any

from spopp.settings.recipes import RECIPE_DEFAULTS

# Each arm: the tracker's recipe and the learner fields it sets, in the order of the chain.
ARMS: dict[str, dict[str, Any]] = {
    "spo": {"recipe": "spo", "learner": {}},
    "spo-eventtime": {"recipe": "spopp", "learner": {"normalization": "trajectory", "dual_clip": 10.0}},
    "spopp-trajnorm": {"recipe": "spopp", "learner": {"normalization": "trajectory"}},
    "spopp": {"recipe": "spopp", "learner": {}},
}
# What each arm has changed from SPO, named for the map's steps and the report's labels.
CHANGES: dict[str, tuple[str, ...]] = {
    "spo": (),
    "spo-eventtime": ("event-time evidence",),
    "spopp-trajnorm": ("event-time evidence", "Dual-Clip 2"),
    "spopp": ("event-time evidence", "Dual-Clip 2", "action-token measure"),
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


def arm_of(recipe: str, normalization: str, dual_clip: float) -> str:
    """The arm a run's recipe and learner settings make: the one whose settings they are, or, for
    settings no arm has (a dual_clip of one's own), the recipe's arm by its normalization."""
    for name, spec in ARMS.items():
        values = {**RECIPE_DEFAULTS[spec["recipe"]], **spec["learner"]}
        if spec["recipe"] == recipe and (values["normalization"], values["dual_clip"]) == (
            normalization,
            dual_clip,
        ):
            return name
    if recipe == "spo":
        return "spo"
    return "spopp" if normalization == "token" else "spopp-trajnorm"


def step_label(arm: str, against: str) -> str:
    """What `arm` adds to `against`, e.g. '+ Dual-Clip 2' (a step of the chain) or 'SPO++ − SPO'."""
    if (arm, against) == ("spopp", "spo"):
        return "SPO++ − SPO"
    added = [c for c in CHANGES[arm] if c not in CHANGES[against]]
    return "+ " + " + ".join(added)
