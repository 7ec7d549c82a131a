"""`spopp tracker serve`: run the app under uvicorn, with an embedded Redis when no URL is given."""

from __future__ import annotations

import logging
import signal
import sys

import uvicorn

from .app import create_app
from .config import TrackerSettings
from .embedded import SupervisedRedis

log = logging.getLogger("spopp.tracker")


def _exit_on_sigterm() -> None:
    # uvicorn re-raises the signal it caught once it has shut down; with Python's default action
    # the process would die there and skip the `finally` that stops the embedded Redis.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def serve(settings: TrackerSettings) -> None:
    _exit_on_sigterm()
    embedded = None
    if settings.redis_url is None:
        # Restarted on the same port and data folder if it dies; /healthz fails if it keeps dying.
        embedded = SupervisedRedis(
            settings.data_dir,
            max_restarts=settings.redis_max_restarts,
            window_seconds=settings.redis_restart_window_seconds,
            start_timeout=settings.redis_wait_seconds,
        ).start()
        settings = settings.model_copy(update={"redis_url": embedded.url})
        print(f"spopp tracker: embedded redis on {embedded.url}, AOF under {embedded.data_dir}", flush=True)
    try:
        uvicorn.run(
            create_app(settings, redis_supervisor=embedded),
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
        )
    finally:
        if embedded is not None:
            embedded.stop()
