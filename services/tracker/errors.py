"""One error type for the API: a status code and a detail body {code, message, ...context}.

A 503 means "not now, retry as it is": it carries a `Retry-After` header (seconds).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from services.shell.overload import RETRY_HEADERS


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, **context: Any) -> None:
        super().__init__(message)
        self.status = status
        self.detail = {"code": code, "message": message, **context}


def error_response(status: int, detail: dict) -> JSONResponse:
    headers = RETRY_HEADERS if status == 503 else None
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def unavailable(detail: dict) -> JSONResponse:
    return error_response(503, detail)
