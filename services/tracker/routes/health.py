"""Liveness, readiness (Redis answers) and Prometheus metrics; outside /v1 and its auth."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..deps import StoreDep
from ..errors import ApiError

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(store: StoreDep) -> dict:
    try:
        await store.redis.ping()
    except Exception as exc:  # any failure to reach Redis means not ready
        raise ApiError(503, "redis_unavailable", f"redis is not reachable: {exc}") from exc
    return {"status": "ready"}


@router.get("/metrics")
async def metrics(request: Request, store: StoreDep) -> Response:
    body = await request.app.state.metrics.render(store)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
