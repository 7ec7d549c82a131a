"""ASGI middleware shared by the services: body-size limits (413) and bearer-token auth (401)."""

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


class ThreadedServer:
    """An ASGI app under uvicorn in a background thread: the learner's intake beside its training
    loop, and the stand-in learner of rollout tests. `port=0` picks a free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import socket
        import threading

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"http-{port}")

    def start(self, timeout: float = 10.0) -> ThreadedServer:
        import time

        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_in_loop(app, host: str, port: int):
    """A uvicorn server for a service whose own loop owns SIGTERM and SIGINT (a replica drains its
    episodes, the evaluator drops its hold): uvicorn's signal capture is left out, so a signal
    stops the service, which then stops the server. Answers the server; `await server.serve()`."""
    import contextlib

    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return _Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
