"""The environment a process plays episodes in, as a settings group: the rollout replica's, the
evaluator's and `spopp prior`'s settings all take it from here, so the three read the same two fields
(a launched run sets them once, at its top level)."""

from __future__ import annotations

from pydantic import Field

from spopp.settings.base import SettingsGroup

from .registry import ENV_HELP, EnvName, EnvOptions


class EnvChoice(SettingsGroup):
    """The environment episodes are played in, and its arguments."""

    env: EnvName = Field("math-tir", description=ENV_HELP)
    env_options: EnvOptions = Field(
        default_factory=dict,
        description="the environment's arguments, a mapping: {max_steps: 50, action_format: tag} (alfworld)",
    )
