"""PUT /v1/runs/{run}/tasks registers tasks with their priors; GET one task's evidence."""

from __future__ import annotations

from fastapi import APIRouter

from spopp.tracker_api import MAX_TASKS_PER_CALL, Id, PutTasks, PutTasksResult, TaskState

from ..deps import RunName, StoreDep
from ..errors import ApiError

router = APIRouter(tags=["tasks"])


@router.put("/runs/{run}/tasks", response_model=PutTasksResult)
async def put_tasks(run: RunName, body: PutTasks, store: StoreDep) -> dict:
    ids = [t.task_id for t in body.tasks]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:20]
        raise ApiError(422, "duplicate_task", "a task_id appears twice in one call", task_ids=dup)
    if len(ids) > MAX_TASKS_PER_CALL:
        raise ApiError(413, "too_many_tasks", f"at most {MAX_TASKS_PER_CALL} tasks per call", count=len(ids))
    return await store.put_tasks(run, body.tasks)


@router.get("/runs/{run}/tasks/{task_id}", response_model=TaskState)
async def get_task(run: RunName, task_id: Id, store: StoreDep) -> dict:
    return (await store.read_tasks(run, [task_id]))[0]
