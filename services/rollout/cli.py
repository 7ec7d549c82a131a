"""`spopp rollout ...`: the rollout replica's sub-commands."""

from __future__ import annotations

import click

from services.config.rollout import RolloutSettings
from spopp.settings.base import settings_command


def _claimed(s: RolloutSettings) -> RolloutSettings:
    """With `claim_dir`: claim a free device or slot (held until the process ends) and take the
    worker id and port from it; write `claim_record`. Runs before .serve is imported: that pulls
    in the engines, and a claimed GPU must be in CUDA_VISIBLE_DEVICES before torch or vLLM start."""
    import logging

    from spopp.machine.claim import ClaimError, claim_at_start

    try:
        worker_id, port = claim_at_start(s, "rollout", logging.getLogger("spopp.rollout"))
    except ClaimError as exc:
        click.echo(f"Error: {exc}", err=True)  # a plain message and exit code 2, no traceback
        raise click.exceptions.Exit(2) from None
    if (worker_id, port) == (s.worker_id, s.port):
        return s  # nothing claimed
    return s.model_copy(update={"worker_id": worker_id, "port": port})


def _serve(settings: RolloutSettings) -> None:
    import asyncio
    import gc

    from services.shell.logs import bind, setup_logging

    setup_logging("rollout", settings.log_format, run=settings.run, worker=settings.worker_id)
    settings = _claimed(settings)
    bind(worker=settings.worker_id)  # the claim's (rollout-gpu3, rollout-0)

    from .serve import serve

    asyncio.run(serve(settings))
    # Stopped cleanly. The interpreter's exit would still run a last full garbage collection over
    # every object its imports made (torch, transformers, sympy: some 380k), which took 2.7-6 s on
    # 2 cores at load 8-9, after the replica's last line; frozen objects are left out of it (the
    # exit then took 0.25-0.8 s), and the OS reclaims their memory anyway.
    gc.freeze()


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
