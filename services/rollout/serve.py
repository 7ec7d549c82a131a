"""`spopp rollout serve`: one replica = engine + worker loop + the service shell's /healthz and /metrics."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI

from runtime.chat_endpoint import MAX_CHAT_BODY_BYTES, add_chat_routes, served_url
from runtime.envs import env_factory
from runtime.envs.base import Task
from services.config.rollout import RolloutSettings
from services.shell import server as http
from services.shell.routes import service_app

from .worker import Worker, read_run

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
    """/healthz, /readyz, /metrics; and where the environment is an agent's, the episodes' chat
    routes (`runtime.chat_endpoint`: each episode's own token, not the cluster's)."""
    sessions = worker.agent_sessions
    app = service_app(
        "spopp rollout",
        health=lambda: {
            "status": "ok",
            "worker_id": worker.s.worker_id,  # a claimed replica's id (rollout-gpu3, rollout-0)
            "device": worker.engine.device_name,  # where its engine generates: cpu, cuda:0
            "policy_version": worker.version,
            "in_flight": len(worker.inflight),
        },
        metrics=worker.metrics.registry,
        max_body_bytes=MAX_CHAT_BODY_BYTES if sessions is not None else None,
    )
    if sessions is not None:
        add_chat_routes(app, sessions)
    return app


async def serve(s: RolloutSettings) -> None:
    from runtime.engines.factory import make_engine

    tasks = load_task_table(s)
    make_env = env_factory(s.env, s.env_options)
    engine = make_engine(s.engine, s.model, **s.engine_kwargs())
    try:
        # The run's record first (retried for retry_seconds): the worker is built from it.
        worker = Worker(s, await read_run(s), engine, make_env, tasks)
        log.info(
            "rollout %s: run %s, %d tasks, engine %s on %s",
            s.worker_id, s.run, len(tasks), s.engine, engine.device_name,
        )  # fmt: skip
        try:
            # A signal stops dispatching and drains (worker.shutdown); run() then returns by itself.
            await http.serve(
                health_app(worker), s.host, s.port, worker.run(max_episodes=s.max_episodes),
                on_signal=lambda: asyncio.ensure_future(worker.shutdown()), limits=s.server_limits(),
                bound=lambda port: worker.serve_agents_at(served_url(s.host, port)),
            )  # fmt: skip
        finally:
            await worker.close()
    finally:
        await engine.close()
