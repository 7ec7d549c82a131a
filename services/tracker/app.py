"""The tracker's FastAPI app: routers under /v1 behind optional bearer auth, uniform error bodies.

Every error answers {"detail": {"code", "message", ...context}}; validation errors name the field.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException

from spopp import __version__
from spopp.asgi import BearerAuth, BodyLimit

from .config import TrackerSettings
from .errors import ApiError
from .metrics import Metrics, MetricsMiddleware
from .routes import consume, dispatch, export, health, outcomes, policy, requests, runs, tasks, values
from .store import Store

log = logging.getLogger("spopp.tracker")
V1_ROUTERS = (runs, tasks, dispatch, outcomes, requests, values, consume, policy, export)


async def wait_for_redis(client: aioredis.Redis, seconds: float) -> None:
    """Retry PING until Redis answers: in compose the tracker may start before Redis does."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    delay = 0.05
    while True:
        try:
            await client.ping()
            return
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            if loop.time() > deadline:
                raise RuntimeError(f"redis did not answer within {seconds:.0f} s: {exc}") from exc
            log.info("waiting for redis: %s", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


def _field(loc) -> str:
    return ".".join(str(p) for p in loc if p != "body") or "body"


def _validation_message(exc: RequestValidationError) -> JSONResponse:
    errors = [{"field": _field(e["loc"]), "message": e["msg"], "type": e["type"]} for e in exc.errors()]
    first = errors[0] if errors else {"field": "body", "message": "invalid request"}
    detail = {"code": "invalid", "message": f"{first['field']}: {first['message']}", "errors": errors}
    return JSONResponse({"detail": detail}, status_code=422)


def create_app(settings: TrackerSettings | None = None) -> FastAPI:
    settings = settings or TrackerSettings.resolve()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
        await wait_for_redis(client, settings.redis_wait_seconds)
        app.state.store = Store(client)
        yield
        await client.aclose()

    app = FastAPI(title="spopp tracker", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = Metrics()
    for module in V1_ROUTERS:
        app.include_router(module.router, prefix="/v1")
    app.include_router(health.router)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(BearerAuth, token=settings.api_token)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_message(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(
            {"detail": {"code": code, "message": str(exc.detail)}}, status_code=exc.status_code
        )

    @app.exception_handler(RedisConnectionError)
    async def redis_down(request: Request, exc: RedisConnectionError) -> JSONResponse:
        detail = {"code": "redis_unavailable", "message": f"redis is not reachable: {exc}"}
        return JSONResponse({"detail": detail}, status_code=503)

    return app
