"""POST /v1/runs/{run}/dispatch: lease up to max_requests idle tasks, values frozen now."""

from __future__ import annotations

from fastapi import APIRouter

from spopp.api.tracker_api import DispatchBody, Dispatched

from ..deps import RunName, StoreDep

router = APIRouter(tags=["dispatch"])


@router.post("/runs/{run}/dispatch", response_model=Dispatched)
async def dispatch(run: RunName, body: DispatchBody, store: StoreDep) -> dict:
    return await store.dispatch(
        run, body.worker_id, body.policy_version, body.max_requests, body.idempotency_key
    )
