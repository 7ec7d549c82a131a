"""`spopp rollout ...`: the rollout replica's sub-commands."""

from __future__ import annotations

import click

from spopp.settings import settings_command

from .config import RolloutSettings


def _serve(settings: RolloutSettings) -> None:
    import asyncio
    import logging

    from .serve import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(settings))


group = click.Group("rollout", help="Rollout replicas: engine, agent loop, environments.")
group.add_command(
    settings_command(
        RolloutSettings,
        "serve",
        _serve,
        help="Run a rollout replica: dispatch from the tracker, play episodes, report outcomes, "
        "push trajectories to the learner.",
    )
)
