"""The chat endpoint over HTTP on 127.0.0.1, for a process that serves no HTTP of its own.

An agent may run its loop in a child process (a CLI tool, another language's client): the child
needs a URL. A replica and the evaluator serve the episodes' routes on their own port; `spopp env
check` and `spopp prior` serve none, so the first agent that asks for its endpoint there starts
this server: a socket bound now (the URL is known at once, and a client that connects before the
first accept waits in the backlog), served by uvicorn as a task of the running event loop, the
loop the episodes' engine runs on. Loopback only, with uvicorn's own bounds (connections, keep-alive);
the routes check each episode's token and bound each body (runtime/chat_endpoint.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

# Connections at once: a check plays a handful of episodes, each with one client.
MAX_CONNECTIONS = 64
KEEP_ALIVE_S = 5


class _BodyCap:
    """Refuses a request whose body passes `limit` bytes (413 by its Content-Length, before a byte
    is read; a disconnect for the app once a chunked body passes it): the services' shell bounds
    bodies for them, and this server has no shell."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            await send({"type": "http.response.start", "status": 413, "headers": [(b"connection", b"close")]})
            return await send({"type": "http.response.body", "body": b""})
        seen = 0

        async def capped():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            return {"type": "http.disconnect"} if seen > self.limit else message

        return await self.app(scope, capped, send)


class LocalServer:
    """`app` on 127.0.0.1 at a free port, served on `loop` until the loop ends or `close()`;
    bodies over `max_body_bytes` are refused."""

    def __init__(self, app, loop: asyncio.AbstractEventLoop, max_body_bytes: int) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield  # the process's own handlers stay: this server is a guest on its loop

        self.loop = loop
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(MAX_CONNECTIONS)
        port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        config = uvicorn.Config(
            _BodyCap(app, max_body_bytes),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            log_config=None,
            limit_concurrency=MAX_CONNECTIONS,
            timeout_keep_alive=KEEP_ALIVE_S,
            lifespan="off",  # the app has no start-up; on, a loop closed under it logs a traceback
        )
        self.server = _Server(config)
        self.task = loop.create_task(self.server.serve(sockets=[self.sock]), name=f"chat-endpoint-{port}")

    def close(self) -> None:
        self.server.should_exit = True
        if self.loop.is_closed():
            self.sock.close()
