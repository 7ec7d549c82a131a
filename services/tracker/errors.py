"""One error type for the API: a status code and a detail body {code, message, ...context}."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, **context: Any) -> None:
        super().__init__(message)
        self.status = status
        self.detail = {"code": code, "message": message, **context}
