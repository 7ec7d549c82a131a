"""`spopp learner ...`: the learner's sub-commands (also `python -m services.learner.cli`, which
torchrun runs once per rank)."""

from __future__ import annotations

import click

from spopp.settings import settings_command

from .config import LearnerSettings


def _finished_already(settings: LearnerSettings) -> bool:
    """Whether the tracker says the run is finished: then there is nothing to train, and the
    learner exits 0 before it loads anything (a restarted or relaunched learner, a resume)."""
    import logging

    from spopp.client import TrackerClient

    with TrackerClient(settings.tracker, token=settings.api_token) as tracker:
        run = tracker.get_run(settings.run)
    if run.status != "finished":
        return False
    logging.getLogger("spopp.learner").info(
        "run %s is finished at version %d: nothing to train", settings.run, run.final_version
    )
    return True


def _run(settings: LearnerSettings, nproc: int, resume: bool) -> None:
    import os

    from runtime.service.logs import setup_logging

    from . import ranks

    rank = os.environ.get("RANK") if ranks.is_rank() else None  # torchrun's rank of this process
    setup_logging("learner", settings.log_format, run=settings.run, rank=rank)
    if ranks.is_rank():
        ranks.die_with_launcher()
    if _finished_already(settings):
        return
    if not ranks.is_rank() and nproc > 1:
        ranks.relaunch(settings, nproc, resume)  # does not return
    from .trainer import Learner

    Learner(settings, resume=resume).run()


_RESUME_HELP = (
    "continue from the newest checkpoint under `checkpoints` (weights, optimizer, step, policy "
    "version, RNG, buffered trajectories); with no checkpoint there, start fresh"
)

group = click.Group("learner", help="The learner: DeepSpeed updates, snapshots, the policy clock.")
group.add_command(
    settings_command(
        LearnerSettings,
        "run",
        _run,
        help="Train on the first trajectories of each policy version; publish snapshots to the tracker.",
        extra_params=[
            click.Option(
                ["--nproc"],
                type=click.IntRange(1, 1024),
                default=1,
                show_default=True,
                help="processes on this node (relaunches under torchrun)",
            ),
            click.Option(["--resume"], is_flag=True, help=_RESUME_HELP),
        ],
    )
)

if __name__ == "__main__":
    group(prog_name="spopp learner")
