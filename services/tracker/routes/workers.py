"""A worker's own routes.

POST /v1/runs/{run}/workers/{worker_id}: a heartbeat with the worker's cumulative counts
(trajectories the learner accepted, episodes finished). The tracker keeps the largest counts it has
seen, so they are monotone; what the worker leased and reported it counts itself.

POST /v1/runs/{run}/workers/{worker_id}/release: every live lease the worker holds goes back at
once. A replica restarted under the same worker id calls it before its first dispatch (only one
process holds a worker id at a time: the launcher names its children, compose's replicas claim
their id by lock), so the tasks its previous life held rejoin the race now, not at lease expiry."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from spopp.api.tracker_api import HeartbeatBody, WorkerBeat, WorkerReleased
from spopp.settings.fields import WorkerId

from ..deps import RunName, StoreDep

router = APIRouter(tags=["workers"])


@router.post("/runs/{run}/workers/{worker_id}", response_model=WorkerBeat)
async def heartbeat(
    run: RunName,
    worker_id: Annotated[WorkerId, Path(description="the worker's id (what it dispatches as)")],
    body: HeartbeatBody,
    store: StoreDep,
) -> dict:
    return await store.heartbeat(run, worker_id, body.trajectories, body.episodes)


@router.post("/runs/{run}/workers/{worker_id}/release", response_model=WorkerReleased)
async def release_worker(
    run: RunName,
    worker_id: Annotated[WorkerId, Path(description="the worker whose leases go back")],
    store: StoreDep,
) -> dict:
    return await store.release_worker(run, worker_id)
