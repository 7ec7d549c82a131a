"""PUT/GET /v1/runs/{run}: create a run (idempotent for the same body) and read it; POST
/v1/runs/{run}/finish marks it finished at its current version (no new leases, no new versions),
/budget changes its max_updates (fixed at creation; changed only by this explicit call, which
`spopp launch` makes), and /reopen undoes a finish when its budget grew."""

from __future__ import annotations

from fastapi import APIRouter, Response

from spopp.api.tracker_api import BudgetBody, FinishBody, ReopenBody, Run, RunConfig

from ..deps import RunName, StoreDep

router = APIRouter(tags=["runs"])


@router.put("/runs/{run}", response_model=Run, status_code=201)
async def put_run(run: RunName, body: RunConfig, store: StoreDep, response: Response) -> dict:
    if not await store.put_run(run, body):
        response.status_code = 200
    return await store.get_run(run)


@router.get("/runs/{run}", response_model=Run)
async def get_run(run: RunName, store: StoreDep) -> dict:
    return await store.get_run(run)


@router.post("/runs/{run}/finish", response_model=Run)
async def finish(run: RunName, body: FinishBody, store: StoreDep) -> dict:
    await store.finish(run, body.version, body.reason)
    return await store.get_run(run)


@router.post("/runs/{run}/reopen", response_model=Run)
async def reopen(run: RunName, body: ReopenBody, store: StoreDep) -> dict:
    await store.reopen(run, body.version)
    return await store.get_run(run)


@router.post("/runs/{run}/budget", response_model=Run)
async def budget(run: RunName, body: BudgetBody, store: StoreDep) -> dict:
    await store.set_budget(run, body.max_updates)
    return await store.get_run(run)
