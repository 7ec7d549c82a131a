"""`spopp rollout serve`: one replica = engine + worker loop + a small /healthz and /metrics app."""

from __future__ import annotations

import asyncio
import logging
import signal

from fastapi import FastAPI, Response
from prometheus_client import generate_latest

from runtime.envs import env_factory
from runtime.envs.base import Task
from spopp.asgi import serve_in_loop

from .config import RolloutSettings
from .worker import Worker

log = logging.getLogger("spopp.rollout")


def load_task_table(s: RolloutSettings) -> dict[str, Task]:
    from runtime.tasks import generate_arithmetic_tasks, load_tasks

    if s.tasks is not None:
        tasks = load_tasks(s.tasks)
    elif s.generated_tasks:
        tasks = generate_arithmetic_tasks(s.generated_tasks, seed=s.task_seed)
    else:
        raise ValueError("give --tasks FILE or --generated-tasks N")
    return {t.task_id: t for t in tasks}


def health_app(worker: Worker) -> FastAPI:
    app = FastAPI(title="spopp rollout")

    @app.get("/healthz")
    async def healthz() -> dict:
        return {
            "status": "ok",
            "worker_id": worker.s.worker_id,  # a claimed replica's id (rollout-gpu3, rollout-0)
            "policy_version": worker.version,
            "in_flight": len(worker.inflight),
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(worker.metrics.registry), media_type="text/plain; version=0.0.4")

    return app


async def serve(s: RolloutSettings) -> None:
    from runtime.engines.factory import make_engine

    tasks = load_task_table(s)
    make_env = env_factory(s.env, s.env_options)
    engine = make_engine(s.engine, s.model, **s.engine_kwargs())
    worker = Worker(s, engine, make_env, tasks)
    server = serve_in_loop(health_app(worker), s.host, s.port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(worker.shutdown()))
    http = asyncio.create_task(server.serve())
    log.info("rollout %s: run %s, %d tasks, engine %s", s.worker_id, s.run, len(tasks), s.engine)
    try:
        await worker.run(max_episodes=s.max_episodes)
    finally:
        server.should_exit = True
        await http
        await worker.close()
        await engine.close()
