"""Liveness, readiness (Redis answers) and Prometheus metrics; outside /v1 and its auth.

/readyz: Redis answers now (503 while it does not: send no traffic). /healthz: the process can
still recover by itself (503 once the embedded Redis's supervisor gave up restarting it, or Redis
has not answered for redis_down_seconds: restart the tracker).
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..deps import StoreDep
from ..errors import unavailable

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(request: Request):
    health = getattr(request.app.state, "health", None)
    if health is None:  # not started yet
        return {"status": "ok"}
    healthy, body = health.check()
    return body if healthy else unavailable(body)


@router.get("/readyz")
async def readyz(store: StoreDep):
    try:
        await store.redis.ping()
    except Exception as exc:  # any failure to reach Redis means not ready
        return unavailable({"code": "redis_unavailable", "message": f"redis is not reachable: {exc}"})
    return {"status": "ready"}


@router.get("/metrics")
async def metrics(request: Request, store: StoreDep) -> Response:
    body = await request.app.state.metrics.render(store, getattr(request.app.state, "health", None))
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
