"""/healthz, /readyz and /metrics: the routes every spopp service answers, outside /v1 and its auth;
and the API's error bodies for what FastAPI itself refuses (404, 405, a body it cannot parse, a
schema error), so that every service answers every error as {"detail": {"code", "message", ...}}.

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

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException

from services.shell.middleware import BodyLimit, invalid_detail, short_errors
from services.shell.overload import RETRY_HEADERS

from .prometheus import CONTENT_TYPE, render

Registries = CollectorRegistry | Iterable[CollectorRegistry]
# The codes of FastAPI's own refusals (400: a body that is no JSON Python can read, such as bad
# UTF-8, an integer of over 4300 digits, arrays nested past the recursion limit).
HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}
# The body limit of an app with no route that reads a body (a replica's, the evaluator's and the
# launcher's /healthz and /metrics): a bigger declared length is refused at once (and no body is
# read by anything: BodyLimit only counts what a route reads).
NO_BODY_MAX_BYTES = 64 * 1024


class Unavailable(Exception):
    """What a probe raises for a 503; `detail` is {code, message, ...context}."""

    def __init__(self, detail: dict) -> None:
        super().__init__(detail.get("message", "unavailable"))
        self.detail = detail


def unavailable_response(detail: dict) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=503, headers=RETRY_HEADERS)


async def _call(fn: Callable[[], Any]) -> Any:
    got = fn()
    return await got if inspect.isawaitable(got) else got


async def _probe(fn: Callable[[], Any]) -> Any:
    try:
        return await _call(fn)
    except Unavailable as exc:
        return unavailable_response(exc.detail)


def http_error_response(exc: HTTPException) -> JSONResponse:
    code = HTTP_CODES.get(exc.status_code, "http_error")
    detail = exc.detail if isinstance(exc.detail, str) else "http error"
    return JSONResponse(
        {"detail": {"code": code, "message": detail[:200]}},
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


def add_error_handlers(app: FastAPI) -> None:
    """FastAPI's own refusals in the API's shape: 404/405/400 as {code, message}, a schema error
    as 422 invalid_detail (first errors and their count, no input echoed). A service with
    refusals of its own (the tracker's 413 too_many_tasks, the learner's counted refusals)
    registers its validation handler after this one, which replaces it."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return http_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": invalid_detail(*short_errors(exc.errors()))}, status_code=422)


def service_app(
    title: str,
    health: Callable[[], Any],
    metrics: Registries | Callable[[], Any],
    ready: Callable[[], Any] | None = None,
    max_body_bytes: int | None = None,
    max_body_bytes_in_flight: int | None = None,
) -> FastAPI:
    """The app of a service whose only routes are /healthz, /readyz and /metrics (a rollout
    replica, the evaluator, the launcher): no API docs (it has no API), the API's error bodies,
    and bodies (which no route reads, nor anything else) refused past NO_BODY_MAX_BYTES when
    declared; a replica that also serves its agents' chat routes gives their bound as
    `max_body_bytes` (and what its requests in flight may hold together as
    `max_body_bytes_in_flight`, default `middleware.default_in_flight`)."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    add_service_routes(app, health, metrics, ready)
    app.add_middleware(
        BodyLimit, max_bytes=max_body_bytes or NO_BODY_MAX_BYTES, in_flight_bytes=max_body_bytes_in_flight
    )
    return app


def add_service_routes(
    app: FastAPI,
    health: Callable[[], Any],
    metrics: Registries | Callable[[], Any],
    ready: Callable[[], Any] | None = None,
) -> None:
    """Add the three routes to `app`, and the API's error bodies (add_error_handlers).
    `metrics`: the registries, or a function answering them at each scrape. `ready` None: ready
    whenever healthy."""
    ready = ready or health
    add_error_handlers(app)

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
