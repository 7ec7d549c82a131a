"""`spopp tracker serve`: run the app under uvicorn, with an embedded Redis when no URL is given."""

from __future__ import annotations

import logging

import uvicorn

from .app import create_app
from .config import TrackerSettings
from .embedded import EmbeddedRedis

log = logging.getLogger("spopp.tracker")


def serve(settings: TrackerSettings) -> None:
    embedded = None
    if settings.redis_url is None:
        embedded = EmbeddedRedis(settings.data_dir).start()
        settings = settings.model_copy(update={"redis_url": embedded.url})
        print(f"spopp tracker: embedded redis on {embedded.url}, AOF under {embedded.data_dir}", flush=True)
    try:
        uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)
    finally:
        if embedded is not None:
            embedded.stop()
