"""/healthz, /readyz and /metrics: the routes every spopp service answers, outside /v1 and its auth.

/healthz says whether the process is alive and can recover by itself (503: restart it);
/readyz whether it can take traffic now (503: send none yet); a service with nothing to wait
for is ready when it is healthy. A probe answers the body of a 200, or raises `Unavailable` with
the body of a 503 (`{"detail": ...}` with a `Retry-After`, like every 503 of the API). Probes
and the metrics source may be plain or async functions: the tracker's read Redis.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from .prometheus import CONTENT_TYPE, render

Registries = CollectorRegistry | Iterable[CollectorRegistry]
RETRY_AFTER_SECONDS = 1


class Unavailable(Exception):
    """What a probe raises for a 503; `detail` is {code, message, ...context}."""

    def __init__(self, detail: dict) -> None:
        super().__init__(detail.get("message", "unavailable"))
        self.detail = detail


def unavailable_response(detail: dict) -> JSONResponse:
    return JSONResponse(
        {"detail": detail}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
    )


async def _call(fn: Callable[[], Any]) -> Any:
    got = fn()
    return await got if inspect.isawaitable(got) else got


async def _probe(fn: Callable[[], Any]) -> Any:
    try:
        return await _call(fn)
    except Unavailable as exc:
        return unavailable_response(exc.detail)


def add_service_routes(
    app: FastAPI,
    health: Callable[[], Any],
    metrics: Registries | Callable[[], Any],
    ready: Callable[[], Any] | None = None,
) -> None:
    """Add the three routes to `app`. `metrics`: the registries, or a function answering them
    at each scrape. `ready` None: ready whenever healthy."""
    ready = ready or health

    @app.get("/healthz", tags=["health"])
    async def healthz():
        return await _probe(health)

    @app.get("/readyz", tags=["health"])
    async def readyz():
        return await _probe(ready)

    @app.get("/metrics", tags=["health"])
    async def prometheus() -> Response:
        registries = await _call(metrics) if callable(metrics) else metrics
        return Response(render(registries), media_type=CONTENT_TYPE)
