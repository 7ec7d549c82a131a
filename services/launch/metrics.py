"""The launcher's own /healthz and /metrics: restarts of its children, for the same scraper that
reads the services' metrics (whether each child is up is its own /healthz's to say).

    spopp_restarts_total{process="rollout-1"} 2

A counter starts from run.json's restarts when a run resumes, so the total is the run's, not one
launch's. The server runs in a thread of the launcher on `metrics_port` (0: a free port), and
its URL is written to run.json as `metrics_url`.
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, disable_created_metrics

from services.shell.routes import service_app
from services.shell.server import ThreadedServer

disable_created_metrics()


class LaunchMetrics:
    def __init__(self, restarts: dict[str, int]) -> None:
        r = self.registry = CollectorRegistry()
        self.restarts = Counter(
            "spopp_restarts",
            "restarts of a launched run's process by its supervisor",
            ["process"],
            registry=r,
        )
        for name, n in restarts.items():
            self.restarts.labels(process=name).inc(n)

    def serve(self, port: int) -> ThreadedServer:
        return ThreadedServer(self.app(), port=port).start()

    def app(self) -> FastAPI:
        """The app `serve` serves: /healthz and /metrics (services.shell.routes.service_app)."""
        return service_app("spopp launch", health=lambda: {"status": "ok"}, metrics=self.registry)
