"""uvicorn under a spopp service: beside the service's own loop, alone, or in a thread.

uvicorn's own logging config and signal capture are left out everywhere. Its loggers propagate to
the one handler of `logs.setup_logging` (so `--log-format json` covers its lines too), and the
service owns SIGTERM and SIGINT: `serve()` turns them into the service's own stop (a replica
drains its episodes, the evaluator drops its hold), then stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

from spopp.net import free_port
from spopp.wait import WaitTimeout, wait_until

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STARTUP_FAILURE = 3  # uvicorn's exit code when the app's start-up fails


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the service's loop owns the signals


def _config(app, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=None)


async def serve(
    app,
    host: str,
    port: int,
    work: Awaitable[Any] | None = None,
    on_signal: Callable[[], Any] | None = None,
    log_level: str = "warning",
) -> Any:
    """Serve `app` until `work` ends (answering its result), or without `work` until a signal.

    On SIGTERM or SIGINT: `on_signal()` when given (the service winds down and `work` ends by
    itself), else `work` is cancelled (its CancelledError reaches the caller). The server stops
    after `work`, so /healthz and /metrics answer while the service winds down. Without `work`,
    SystemExit(3) when the app's start-up failed, as uvicorn.run exits."""
    server = _Server(_config(app, host, port, log_level))
    http = asyncio.ensure_future(server.serve())
    main = asyncio.ensure_future(work) if work is not None else http
    stop = on_signal or (main.cancel if work is not None else lambda: setattr(server, "should_exit", True))
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop)
    try:
        result = await main
    finally:
        # The handlers stay until the loop closes: a second signal while the service cleans up
        # must not kill it half-way (its leases, its hold).
        server.should_exit = True
        await http
    if work is None and not server.started:
        raise SystemExit(STARTUP_FAILURE)
    return result


class ThreadedServer:
    """An ASGI app under uvicorn in a background thread: the learner's intake beside its training
    loop, and the stand-in learner of rollout tests. `port=0` picks a free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        port = port or free_port(host)
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(_config(app, host, port, log_level))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"http-{port}")

    def start(self, timeout: float = 10.0) -> ThreadedServer:
        self.thread.start()
        try:
            wait_until(self._started, timeout, f"the HTTP server on {self.url}", interval=0.01)
        except WaitTimeout:
            raise RuntimeError(f"HTTP server on {self.url} did not start within {timeout:g} s") from None
        return self

    def _started(self) -> bool:
        if not self.server.started and not self.thread.is_alive():
            raise RuntimeError(f"HTTP server on {self.url} did not start: its thread ended (port taken?)")
        return self.server.started

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
