"""GET /v1/runs/{run}/export: every task's evidence as JSON lines, streamed.

Every line is strict JSON (RFC 8259: no NaN or Infinity). The API's bounds keep every number
finite; should a stored value not be (state written before those bounds), it is exported as null
rather than as a token that JSON parsers refuse.
"""

from __future__ import annotations

import json
import math

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from ..deps import RunName, StoreDep

router = APIRouter(tags=["export"])


def _line(row: dict) -> str:
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


@router.get("/runs/{run}/export", response_class=StreamingResponse)
async def export(run: RunName, store: StoreDep) -> StreamingResponse:
    rows = store.export(run)
    # Pull the first row before answering, so an unknown run is a 404 and not a broken stream.
    first = await anext(rows, None)

    async def lines():
        if first is not None:
            yield _line(first)
        async for row in rows:
            yield _line(row)

    return StreamingResponse(lines(), media_type="application/x-ndjson")
