"""The tracker's FastAPI app: routers under /v1 behind optional bearer auth, uniform error bodies.

Every error answers {"detail": {"code", "message", ...context}}; validation errors name the field.
Every 503 (Redis unreachable or too slow, a run's draw stream in contention) carries a
`Retry-After` header: the call may be retried as it is, every state-changing route is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import AuthenticationError, MasterDownError, ReadOnlyError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.config.tracker import TrackerSettings, metrics_need_token, password_from_file
from services.shell.middleware import (
    BearerAuth,
    BodyLimit,
    UniqueJsonKeys,
    field_name,
    invalid_detail,
    short_errors,
)
from spopp import __version__
from spopp.api.tracker_api import MAX_TASKS_PER_CALL
from spopp.machine.retry import RetryPolicy

from .errors import ApiError, error_response, unavailable
from .metrics import Metrics, MetricsMiddleware
from .routes import (
    consume,
    dispatch,
    export,
    health,
    outcomes,
    policy,
    requests,
    runs,
    tasks,
    values,
    workers,
)
from .store import Store

log = logging.getLogger("spopp.tracker")
V1_ROUTERS = (runs, tasks, dispatch, outcomes, requests, values, consume, policy, export, workers)
# Redis cannot serve now, but may soon: refused or reset (BusyLoadingError, a Redis loading its
# AOF, is a ConnectionError too), too slow, or a replica that cannot take writes mid-failover.
REDIS_POOL_SIZE = 64  # within services.shell.connections.FD_RESERVE
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, MasterDownError)


class RedisHealth:
    """When Redis last answered, from a PING every second; what /healthz judges the process by.

    /readyz asks Redis now; /healthz fails only when the process cannot recover by itself: the
    embedded Redis's supervisor gave up, or Redis has not answered for `down_seconds`.
    """

    def __init__(self, client: aioredis.Redis, down_seconds: float, supervisor=None) -> None:
        self.client = client
        self.down_seconds = down_seconds
        self.supervisor = supervisor
        self.last_ok = time.monotonic()
        self.interval = min(1.0, down_seconds / 4)

    async def watch(self) -> None:
        while True:
            try:
                await self.client.ping()
                self.last_ok = time.monotonic()
            except Exception as exc:  # any failure to reach Redis: not answering
                log.debug("redis ping failed: %s", exc)
            await asyncio.sleep(self.interval)

    def status(self) -> dict:
        down_for = time.monotonic() - self.last_ok
        redis = {"last_answer_seconds_ago": round(down_for, 3)}
        redis.update(self.supervisor.status() if self.supervisor is not None else {"embedded": False})
        return redis

    def check(self) -> tuple[bool, dict]:
        """(healthy, what /healthz says)."""
        redis = self.status()
        down_for = redis["last_answer_seconds_ago"]
        if self.supervisor is not None and self.supervisor.failed:
            return False, {
                "code": "redis_failed",
                "message": f"the embedded redis-server cannot be restarted: {self.supervisor.last_error}",
                "redis": redis,
            }
        if down_for > self.down_seconds:
            return False, {
                "code": "redis_unreachable",
                "message": f"redis has not answered for {down_for:.0f} s (bound {self.down_seconds:g} s)",
                "redis": redis,
            }
        return True, {"status": "ok"}


async def wait_for_redis(client: aioredis.Redis, seconds: float) -> None:
    """Retry PING until Redis answers: in compose the tracker may start before Redis does."""
    attempts = RetryPolicy(seconds, initial=0.05, cap=1.0).start()
    while True:
        try:
            await client.ping()
            return
        except (AuthenticationError, ResponseError) as exc:
            # A Redis that answers but refuses us will not change its mind: say so now.
            raise RuntimeError(
                f"redis refused this tracker ({exc}): give its password in redis_password_file"
            ) from exc
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            delay = attempts.next_delay()
            if delay is None:
                raise RuntimeError(f"redis did not answer within {seconds:.0f} s: {exc}") from exc
            log.info("waiting for redis: %s", exc)
            await asyncio.sleep(delay)


def _validation_message(exc: RequestValidationError) -> JSONResponse:
    raw = exc.errors()
    # Tasks per PUT are capped by the model, checked before any task (pydantic checks a list's
    # max_length first), and answered 413 as the API has always answered that cap.
    for e in raw:
        if e["type"] == "too_long" and field_name(e["loc"]) == "tasks":
            count = (e.get("ctx") or {}).get("actual_length")
            return error_response(
                413,
                {
                    "code": "too_many_tasks",
                    "message": f"at most {MAX_TASKS_PER_CALL} tasks per call",
                    "count": count,
                },
            )
    return JSONResponse({"detail": invalid_detail(*short_errors(raw))}, status_code=422)


def write_instance_file(path: Path, instance: str) -> None:
    """The instance id, written whole (a probe never reads half an id)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(instance + "\n")
    tmp.replace(path)


def create_app(settings: TrackerSettings | None = None, redis_supervisor=None) -> FastAPI:
    """The app on `settings.redis_url`; `redis_supervisor` (a SupervisedRedis) when the tracker
    runs its own Redis, so that /healthz can tell when it gave up restarting it."""
    settings = settings or TrackerSettings.resolve()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = settings.redis_timeout_seconds
        # A password in the URL (the embedded Redis's, in this process only) wins over the file's.
        # A bounded pool: requests beyond REDIS_POOL_SIZE wait for a connection (503 after the
        # timeout) rather than each opening one, which would spend two descriptors per request (one
        # here, one in Redis) and run the process out of files under a flood.
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=REDIS_POOL_SIZE, timeout=timeout, decode_responses=True,
            socket_timeout=timeout, socket_connect_timeout=timeout, password=password_from_file(settings),
        )  # fmt: skip
        client = aioredis.Redis.from_pool(pool)
        await wait_for_redis(client, settings.redis_wait_seconds)
        app.state.store = Store(
            client, settings.idempotency_ttl_seconds, settings.max_workers_per_run, settings.max_runs
        )
        app.state.health = RedisHealth(client, settings.redis_down_seconds, redis_supervisor)
        if settings.instance_file is not None:
            write_instance_file(settings.instance_file, app.state.instance)
        watcher = asyncio.create_task(app.state.health.watch())
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await client.aclose()

    app = FastAPI(title="spopp tracker", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    # Who answers: /healthz and /readyz carry it, so a probe can tell this process from a stranger
    # that holds the port (on the host network, the port alone proves nothing).
    app.state.instance = uuid.uuid4().hex
    app.state.metrics = Metrics()
    for module in V1_ROUTERS:
        app.include_router(module.router, prefix="/v1")
    health.add_health_routes(app)
    # Outermost last: auth, then the size limit, then metrics, then repeated JSON keys (only an
    # authorised, bounded body is read for them).
    app.add_middleware(UniqueJsonKeys)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(
        BearerAuth, token=settings.api_token, also=("/metrics",) if metrics_need_token(settings) else ()
    )
    _add_error_handlers(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """The tracker's own errors, validation errors and an unreachable Redis, as uniform error bodies."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.detail)

    # 404, 405 and a body FastAPI cannot parse (400) are answered by the service shell's handler
    # (services.shell.routes.add_error_handlers, added with the health routes).
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_message(exc)

    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        return unavailable({"code": "redis_unavailable", "message": f"redis is not reachable: {exc}"})

    for error in REDIS_DOWN:
        app.add_exception_handler(error, redis_down)
