"""POST /v1/runs/{run}/values: current values of a batch of tasks (SPO reads them pre-update)."""

from __future__ import annotations

from fastapi import APIRouter

from spopp.api.tracker_api import ValuesBody, ValuesResult

from ..deps import RunName, StoreDep

router = APIRouter(tags=["values"])


@router.post("/runs/{run}/values", response_model=ValuesResult)
async def values(run: RunName, body: ValuesBody, store: StoreDep) -> dict:
    rows = await store.read_tasks(run, body.task_ids)
    return {"values": [{k: r[k] for k in ("task_id", "alpha", "beta", "value")} for r in rows]}
