"""A lease's life (POST /v1/runs/{run}/requests/{request_id}/renew and /release), and
POST /v1/runs/{run}/requests/lookup: which requests this run issued, in which state (the learner
checks a batch with it before training on it)."""

from __future__ import annotations

from fastapi import APIRouter

from spopp.api.tracker_api import LookupBody, LookupResult, RequestState
from spopp.settings.fields import Id

from ..deps import RunName, StoreDep

router = APIRouter(tags=["requests"])


@router.post("/runs/{run}/requests/{request_id}/renew", response_model=RequestState)
async def renew(run: RunName, request_id: Id, store: StoreDep) -> dict:
    return await store.renew(run, request_id)


@router.post("/runs/{run}/requests/{request_id}/release", response_model=RequestState)
async def release(run: RunName, request_id: Id, store: StoreDep) -> dict:
    return await store.release(run, request_id)


@router.post("/runs/{run}/requests/lookup", response_model=LookupResult)
async def lookup(run: RunName, body: LookupBody, store: StoreDep) -> dict:
    return {"requests": await store.read_requests(run, body.request_ids)}
