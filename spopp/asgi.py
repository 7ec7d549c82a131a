"""ASGI middleware shared by the services: body-size limits (413) and bearer-token auth (401).

Serving an app (uvicorn beside a service's loop, or in a thread) is the service shell's:
runtime/service/server.py."""

from __future__ import annotations

import json
import secrets


async def send_error(send, status: int, detail: dict, headers: list | None = None) -> None:
    """Answer from inside a middleware with the API's error body {"detail": {...}}."""
    body = json.dumps({"detail": detail}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        # A chunked body has no length up front: read it (up to the limit) before the app does,
        # then replay it, so that an oversized one is refused before anything is parsed.
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        message = f"request body exceeds {self.max_bytes} bytes"
        await send_error(
            send, 413, {"code": "body_too_large", "message": message, "max_bytes": self.max_bytes}
        )


class BearerAuth:
    """Every /v1 route needs `Authorization: Bearer <token>` when a token is configured.

    A middleware rather than a route dependency so that auth is decided before the body is
    parsed: a caller without the token learns nothing from validation errors.
    """

    def __init__(self, app, token: str | None) -> None:
        self.app = app
        self.token = token.encode() if token else None

    async def __call__(self, scope, receive, send):
        if self.token is None or scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(given, self.token):
            return await self.app(scope, receive, send)
        detail = {"code": "unauthorized", "message": "missing or wrong bearer token"}
        await send_error(send, 401, detail, [(b"www-authenticate", b"Bearer")])
