"""The `spopp` command: one sub-command group per service.

Service modules are imported inside the commands, so `spopp --help` stays instant and the CLI
works where only some services' dependencies are installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="spopp: asynchronous single-stream RL (SPO++ and SPO).", no_args_is_help=True)
tracker_app = typer.Typer(
    help="The tracker: prompt evidence, leases, sampler and policy clock.", no_args_is_help=True
)
app.add_typer(tracker_app, name="tracker")


@tracker_app.command("serve")
def tracker_serve(
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind")] = 8000,
    redis_url: Annotated[
        str | None,
        typer.Option(
            envvar="SPOPP_REDIS_URL", help="Redis holding all state; omit to start an embedded redis-server"
        ),
    ] = None,
    data_dir: Annotated[Path, typer.Option(help="AOF folder of the embedded Redis")] = Path(
        "spopp-data/tracker"
    ),
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
) -> None:
    """Serve the tracker's REST API (OpenAPI at /docs). SPOPP_API_TOKEN turns on bearer auth."""
    try:
        from services.tracker.config import TrackerSettings
        from services.tracker.serve import serve
    except ImportError as exc:
        raise typer.BadParameter(
            f"the tracker needs its extras: pip install 'spopp[tracker]' ({exc})"
        ) from exc
    # Flags override the SPOPP_* environment; the token only ever comes from the environment.
    settings = TrackerSettings(
        host=host, port=port, redis_url=redis_url, data_dir=data_dir, log_level=log_level
    )
    serve(settings)


if __name__ == "__main__":
    app()
