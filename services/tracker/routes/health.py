"""Liveness, readiness (Redis answers) and Prometheus metrics; outside /v1 and its auth.

/readyz: Redis answers now (503 while it does not: send no traffic). /healthz: the process can
still recover by itself (503 once the embedded Redis's supervisor gave up restarting it, or Redis
has not answered for redis_down_seconds: restart the tracker). The routes themselves are the
service shell's (services.shell.routes); these are the tracker's probes.
"""

from __future__ import annotations

from fastapi import FastAPI

from services.shell.routes import Unavailable, add_service_routes


def add_health_routes(app: FastAPI) -> None:
    add_service_routes(
        app, health=lambda: healthz(app), ready=lambda: readyz(app), metrics=lambda: scrape(app)
    )


def healthz(app: FastAPI) -> dict:
    health = getattr(app.state, "health", None)
    if health is None:  # not started yet
        return {"status": "ok", **identity(app)}
    healthy, body = health.check()
    if not healthy:
        raise Unavailable({**body, **identity(app)})
    return {**body, **identity(app)}


def identity(app: FastAPI) -> dict:
    """Which process answers (services/tracker/probe.py compares it with the instance file)."""
    return {"service": "tracker", "instance": app.state.instance}


async def readyz(app: FastAPI) -> dict:
    try:
        await app.state.store.redis.ping()
    except Exception as exc:  # any failure to reach Redis means not ready
        raise Unavailable({"code": "redis_unavailable", "message": f"redis is not reachable: {exc}"}) from exc
    return {"status": "ready", **identity(app)}


async def scrape(app: FastAPI) -> list:
    """The registries of one scrape: request counts and latencies, then what Redis holds now."""
    return await app.state.metrics.registries(app.state.store, getattr(app.state, "health", None))
