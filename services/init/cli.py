"""`spopp init`: the command of run creation (create.py)."""

from __future__ import annotations

import click

from services.config.init import InitSettings
from services.init.create import run_init
from services.shell.logs import command_echo
from spopp.settings.base import settings_command


def _init(settings: InitSettings) -> None:
    try:
        run_init(settings, echo=command_echo(settings, "init", run=settings.run))
    except (RuntimeError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


init_command = settings_command(
    InitSettings,
    "init",
    _init,
    help="Create a run at the tracker and load its tasks with their prior (the init step of "
    "docker compose and Kubernetes). Idempotent: a second init with the same settings changes "
    "nothing; a different recipe, config or prior is refused with the reason.",
)
