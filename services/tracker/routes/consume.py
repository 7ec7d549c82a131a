"""POST /v1/runs/{run}/consume: SPO's post-update evidence, applied in learner order."""

from __future__ import annotations

from fastapi import APIRouter

from spopp.api.tracker_api import ConsumeBody, ConsumeResult

from ..deps import RunName, StoreDep

router = APIRouter(tags=["consume"])


@router.post("/runs/{run}/consume", response_model=list[ConsumeResult])
async def consume(run: RunName, body: ConsumeBody, store: StoreDep) -> list[dict]:
    items = [(i.task_id, i.reward, i.drift) for i in body.items]
    return await store.consume(run, body.update_id, items)
