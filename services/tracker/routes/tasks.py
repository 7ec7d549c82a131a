"""PUT /v1/runs/{run}/tasks registers tasks with their priors; GET one task's evidence."""

from __future__ import annotations

from collections import Counter

from fastapi import APIRouter

from spopp.api.tracker_api import PutTasks, PutTasksResult, TaskState
from spopp.settings.fields import Id

from ..deps import RunName, StoreDep
from ..errors import ApiError

router = APIRouter(tags=["tasks"])


@router.put("/runs/{run}/tasks", response_model=PutTasksResult)
async def put_tasks(run: RunName, body: PutTasks, store: StoreDep) -> dict:
    ids = [t.task_id for t in body.tasks]
    # The cap (PutTasks, before its items are validated) first, and the duplicates by one count: a
    # batch of one id repeated 40,000 times once held every route for 20 s in a quadratic check.
    counts = Counter(ids)
    if len(counts) != len(ids):
        dup = sorted(i for i, n in counts.items() if n > 1)[:20]
        raise ApiError(422, "duplicate_task", "a task_id appears twice in one call", task_ids=dup)
    return await store.put_tasks(run, body.tasks)


@router.get("/runs/{run}/tasks/{task_id}", response_model=TaskState)
async def get_task(run: RunName, task_id: Id, store: StoreDep) -> dict:
    return (await store.read_tasks(run, [task_id]))[0]
