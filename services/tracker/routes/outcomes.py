"""POST /v1/runs/{run}/outcomes: report rewards; each is judged against its frozen value."""

from __future__ import annotations

from fastapi import APIRouter

from spopp.api.tracker_api import OutcomesBody, OutcomesResult

from ..deps import RunName, StoreDep

router = APIRouter(tags=["outcomes"])


@router.post("/runs/{run}/outcomes", response_model=OutcomesResult)
async def outcomes(run: RunName, body: OutcomesBody, store: StoreDep) -> dict:
    results = await store.outcomes(run, [(o.request_id, o.reward) for o in body.outcomes])
    return {"results": results}
