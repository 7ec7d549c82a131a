"""`spopp tracker serve`: run the app under uvicorn, with an embedded Redis when no URL is given."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from services.config.tracker import TrackerSettings
from services.shell import server as http

from .app import create_app
from .embedded import SupervisedRedis

log = logging.getLogger("spopp.tracker")


def _exit_on_sigterm() -> None:
    # Until the server's loop takes SIGTERM over (and after it), Python's default action would
    # kill the process there and skip the `finally` that stops the embedded Redis.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def serve(settings: TrackerSettings) -> None:
    _exit_on_sigterm()
    embedded = None
    if settings.redis_url is None:
        # Restarted on the same port and data folder if it dies; /healthz fails if it keeps dying.
        embedded = SupervisedRedis(
            settings.data_dir,
            port=settings.redis_port or None,
            max_restarts=settings.redis_max_restarts,
            window_seconds=settings.redis_restart_window_seconds,
            start_timeout=settings.redis_wait_seconds,
        ).start()
        settings = settings.model_copy(update={"redis_url": embedded.url})
        log.info(
            "spopp tracker: embedded redis on %s (password in %s), AOF under %s",
            embedded.address,
            embedded.data_dir / "redis.password",
            embedded.data_dir,
        )
    if settings.api_token is None:
        # spopp launch always gives its tracker a token (the user's or the run's): this one was
        # started on its own, and whoever reaches the port may read and change every run.
        log.warning(
            "no api_token (SPOPP_API_TOKEN) is set: every /v1 route on %s:%d is open to anyone who reaches it",
            settings.host, settings.port,
        )  # fmt: skip
    try:
        app = create_app(settings, redis_supervisor=embedded)
        if embedded is not None:
            # A stop that overruns its bound must not orphan Redis.
            http.on_overrun(lambda: embedded.stop(2.0))
        limits = settings.server_limits()
        asyncio.run(
            http.serve(app, settings.host, settings.port, log_level=settings.log_level, limits=limits)
        )
    finally:
        _exit_on_sigterm()  # the loop's handler went with the loop
        if embedded is not None:
            embedded.stop()
