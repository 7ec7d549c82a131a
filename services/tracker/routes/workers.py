"""POST /v1/runs/{run}/workers/{worker_id}: a worker's heartbeat with its own cumulative counts
(trajectories the learner accepted, episodes finished). The tracker keeps the largest counts it has
seen, so they are monotone; what the worker leased and reported it counts itself."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from spopp.tracker_api import HeartbeatBody, WorkerBeat, WorkerId

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
