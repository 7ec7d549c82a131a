"""`spopp tracker ...`: the tracker's sub-commands."""

from __future__ import annotations

import click

from services.config.tracker import TrackerSettings
from spopp.settings.base import settings_command


def _serve(settings: TrackerSettings) -> None:
    from services.shell.logs import setup_logging

    setup_logging("tracker", settings.log_format)
    try:
        from .serve import serve
    except ImportError as exc:
        raise click.ClickException(
            f"the tracker needs its extras: pip install 'spopp[tracker]' ({exc})"
        ) from exc
    serve(settings)


group = click.Group("tracker", help="The tracker: prompt evidence, leases, sampler and policy clock.")
group.add_command(
    settings_command(
        TrackerSettings,
        "serve",
        _serve,
        help="Serve the tracker's REST API (OpenAPI at /docs). With no --redis-url it starts an "
        "embedded redis-server with append-only persistence under --data-dir.",
    )
)
