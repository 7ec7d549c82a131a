"""`spopp evaluator ...`: follow a run and score its snapshots, or score model folders; and `spopp prior`,
the cold-start policy's offline prompt values (the same episodes, on the training tasks)."""

from __future__ import annotations

from pathlib import Path

import click

from services.config.evaluator import EvaluatorSettings, ScoreSettings
from services.config.prior import PriorSettings
from spopp.settings.base import settings_command


def _logging(service: str, settings, **context) -> None:
    from services.shell.logs import setup_logging

    setup_logging(service, settings.log_format, **context)


def _claimed(s: EvaluatorSettings) -> EvaluatorSettings:
    """With `claim_dir`: claim a free device (shared with the replicas' claims) or slot, held until
    the process ends, and take the port from it; write `claim_record`. The worker id is the hold's
    name, which stays the same whichever GPU a restart gets (a hold under another name would
    keep snapshots from pruning until it expired). Runs before .follow is imported: a claimed GPU
    must be in CUDA_VISIBLE_DEVICES before torch or vLLM start."""
    import logging

    from spopp.machine.claim import ClaimError, claim_at_start

    try:
        _, port = claim_at_start(
            s, "evaluator", logging.getLogger("spopp.evaluator"), worker_id=s.holder_id()
        )
    except ClaimError as exc:
        click.echo(f"Error: {exc}", err=True)  # a plain message and exit code 2, no traceback
        raise click.exceptions.Exit(2) from None
    return s if port == s.port else s.model_copy(update={"port": port})


def _run(settings: EvaluatorSettings) -> None:
    import asyncio

    _logging("evaluator", settings, run=settings.run, worker=settings.holder_id())
    settings = _claimed(settings)

    from .follow import follow

    asyncio.run(follow(settings))


def _score(settings: ScoreSettings, snapshot: tuple[Path, ...]) -> None:
    import asyncio
    import json

    from .scorer import score_folders

    _logging("evaluator", settings)
    try:
        results = asyncio.run(score_folders(settings, list(snapshot)))
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    for result in results:
        click.echo(json.dumps(result))


group = click.Group("evaluator", help="Held-out evaluation of the policy, in its own process.")
group.add_command(
    settings_command(
        EvaluatorSettings,
        "run",
        _run,
        help="Follow a run's policy clock at the tracker and score every k-th published snapshot "
        "on held-out tasks (records in out_dir; /metrics). Training never waits for it.",
    )
)
group.add_command(
    settings_command(
        ScoreSettings,
        "score",
        _score,
        help="Score model folders (snapshots or any Hugging Face model) on the held-out tasks and "
        "print one JSON line of metrics each.",
        extra_params=[
            click.Option(
                ["--snapshot"],
                type=click.Path(file_okay=False, path_type=Path),
                multiple=True,
                required=True,
                help="a model folder to score (repeatable)",
            )
        ],
    )
)


def _prior(settings: PriorSettings) -> None:
    from .prior import PriorError, run_prior, summary

    _logging("prior", settings)
    try:
        prior = run_prior(settings)
    except (PriorError, FileExistsError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(summary(prior, settings.out))


prior_command = settings_command(
    PriorSettings,
    "prior",
    _prior,
    help="Offline prompt values: play ROLLOUTS sampled episodes per training task with the cold-start "
    "policy and write each task's Jeffreys prior (mass PRIOR_MASS) to OUT, the prior file every run of "
    "a comparison loads. Refuses to replace OUT unless --overwrite.",
)

if __name__ == "__main__":
    group(prog_name="spopp evaluator")
