"""GET /v1/runs/{run}/export: every task's evidence as JSON lines, streamed."""

from __future__ import annotations

import json

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from ..deps import RunName, StoreDep

router = APIRouter(tags=["export"])


@router.get("/runs/{run}/export", response_class=StreamingResponse)
async def export(run: RunName, store: StoreDep) -> StreamingResponse:
    rows = store.export(run)
    # Pull the first row before answering, so an unknown run is a 404 and not a broken stream.
    first = await anext(rows, None)

    async def lines():
        if first is not None:
            yield json.dumps(first) + "\n"
        async for row in rows:
            yield json.dumps(row) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")
