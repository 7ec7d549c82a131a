"""POST /v1/runs/{run}/requests/{request_id}/renew and /release: a lease's life."""

from __future__ import annotations

from fastapi import APIRouter

from spopp.tracker_api import Id, RequestState

from ..deps import RunName, StoreDep

router = APIRouter(tags=["requests"])


@router.post("/runs/{run}/requests/{request_id}/renew", response_model=RequestState)
async def renew(run: RunName, request_id: Id, store: StoreDep) -> dict:
    return await store.renew(run, request_id)


@router.post("/runs/{run}/requests/{request_id}/release", response_model=RequestState)
async def release(run: RunName, request_id: Id, store: StoreDep) -> dict:
    return await store.release(run, request_id)
