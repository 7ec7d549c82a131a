"""GET/POST /v1/runs/{run}/policy: the policy clock, advanced one version at a time."""

from __future__ import annotations

from fastapi import APIRouter

from spopp.api.tracker_api import Policy, PolicyBody

from ..deps import RunName, StoreDep

router = APIRouter(tags=["policy"])


@router.post("/runs/{run}/policy", response_model=Policy)
async def publish(run: RunName, body: PolicyBody, store: StoreDep) -> dict:
    await store.publish(run, body.version, body.snapshot)
    return await store.policy(run)


@router.get("/runs/{run}/policy", response_model=Policy)
async def policy(run: RunName, store: StoreDep) -> dict:
    return await store.policy(run)
