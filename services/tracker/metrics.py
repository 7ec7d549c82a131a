"""Prometheus metrics: request counts and latency per route, plus per-run and per-worker series
read at scrape time.

The registry belongs to the app (not the process-global one) so several apps in one process,
as in tests, do not collide. Run and worker series come from Redis on each scrape, so every
tracker process reports the same numbers; the tracker's bound on workers per run bounds them.
"""

from __future__ import annotations

import time
from datetime import datetime

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# *_created series double the scrape for no use here.
disable_created_metrics()


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "spopp_tracker_requests", "HTTP requests", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "spopp_tracker_request_seconds",
            "HTTP request latency",
            ["route"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )

    async def registries(self, store, health=None) -> list[CollectorRegistry]:
        """This process's request metrics, and a registry of the run, worker and Redis series
        read now (rendered by the service shell, services.shell.prometheus)."""
        # Two Redis round trips whatever the number of runs (Store.scrape).
        scraped = await store.scrape()
        runs = {run: got["counts"] for run, got in scraped.items()}
        workers = {run: got["workers"] for run, got in scraped.items()}
        registry = CollectorRegistry()
        registry.register(_RunCollector(runs))
        registry.register(_WorkerCollector(workers))
        if health is not None:
            registry.register(_RedisCollector(health.status()))
        return [self.registry, registry]


# HTTP methods are labelled as they are; any other (a client may send any token as a method)
# as "other", so that no caller grows the request counter by a series per made-up method.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class MetricsMiddleware:
    """Pure ASGI: counts and times every request without BaseHTTPMiddleware's per-call copying
    (which cost about as much as the work of a dispatch here)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def record(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            # The router writes the matched route into the scope; label by its template.
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.requests.labels(method, route, str(status)).inc()


class _RunCollector:
    _GAUGES = {
        "tasks": ("spopp_tracker_tasks", "tasks registered"),
        "in_flight": ("spopp_tracker_leases_in_flight", "live leases"),
        "idle": ("spopp_tracker_tasks_idle", "tasks waiting in the sampler"),
    }
    _COUNTERS = {
        "dispatches": ("spopp_tracker_dispatches", "requests dispatched"),
        "outcomes": ("spopp_tracker_outcomes", "outcomes counted"),
        "expirations": ("spopp_tracker_lease_expirations", "leases that expired"),
    }

    def __init__(self, runs: dict[str, dict]) -> None:
        self.runs = runs

    def collect(self):
        for key, (name, doc) in self._GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["run"])
            for run, counts in self.runs.items():
                family.add_metric([run], counts[key])
            yield family
        for key, (name, doc) in self._COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["run"])
            for run, counts in self.runs.items():
                family.add_metric([run], counts[key])
            yield family


class _WorkerCollector:
    """Per worker and run: what it leased and reported (counted by the tracker), the trajectories
    the learner accepted from it (its own report, monotone), and when the tracker last saw it."""

    _COUNTERS = {
        "leases": ("spopp_tracker_worker_leases", "requests leased to the worker"),
        "outcomes": ("spopp_tracker_worker_outcomes", "outcomes accepted for the worker's requests"),
        "trajectories": ("spopp_tracker_worker_trajectories", "trajectories the learner accepted (reported)"),
        "episodes": ("spopp_tracker_worker_episodes", "episodes the worker finished (reported)"),
    }

    def __init__(self, runs: dict[str, dict[str, dict]]) -> None:
        self.runs = runs

    def collect(self):
        rows = [(run, worker, stats) for run, ws in self.runs.items() for worker, stats in ws.items()]
        for key, (name, doc) in self._COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["run", "worker"])
            for run, worker, stats in rows:
                family.add_metric([run, worker], stats[key])
            yield family
        seen = GaugeMetricFamily(
            "spopp_tracker_worker_last_seen_timestamp_seconds",
            "when the tracker last heard from the worker (Redis clock, Unix seconds)",
            labels=["run", "worker"],
        )
        for run, worker, stats in rows:
            seen.add_metric([run, worker], datetime.fromisoformat(stats["last_seen"]).timestamp())
        yield seen


class _RedisCollector:
    """The Redis behind this process: how long since it last answered, and (embedded) restarts."""

    def __init__(self, status: dict) -> None:
        self.status = status

    def collect(self):
        yield GaugeMetricFamily(
            "spopp_tracker_redis_last_answer_seconds",
            "seconds since Redis last answered this process's health ping",
            value=self.status["last_answer_seconds_ago"],
        )
        if self.status.get("embedded"):
            yield CounterMetricFamily(
                "spopp_tracker_redis_restarts",
                "restarts of the embedded redis-server",
                value=self.status["restarts"],
            )
