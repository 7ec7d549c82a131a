"""uvicorn under a spopp service: beside the service's own loop, alone, or in a thread.

uvicorn's own logging config and signal capture are left out everywhere. Its loggers propagate to
the one handler of `logs.setup_logging` (so `--log-format json` covers its lines too), and the
service owns SIGTERM and SIGINT: `serve()` turns them into the service's own stop (a replica
drains its episodes, the evaluator drops its hold), then stops the server.

Every server runs under `ServerLimits` (connections.py: header and body deadlines, a connection
cap under the file limit). Once the server is told to stop, requests in flight get
`shutdown_timeout`; if the process is still not done SHUTDOWN_GRACE seconds after that (a lifespan
that hangs, a loop flooded with callbacks), a watchdog thread runs the overrun hooks (the tracker's:
stop its embedded Redis) and exits the process with EXIT_OVERRUN.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import click
import uvicorn

from spopp.machine.wait import WaitTimeout, wait_until

from .connections import ACCEPT_BURST, ServerLimits, protocol_class

log = logging.getLogger("spopp.http")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STARTUP_FAILURE = 3  # uvicorn's exit code when the app's start-up fails
EXIT_OVERRUN = 70  # the process did not stop within its bound and was ended by the watchdog
SHUTDOWN_GRACE = 5.0

_overrun_hooks: list[Callable[[], Any]] = []


def on_overrun(hook: Callable[[], Any]) -> None:
    """Run `hook` (in the watchdog's thread) before an overrunning process is ended: what must not
    outlive the process, such as a child server it started."""
    _overrun_hooks.append(hook)


def _end_overrun(bound: float) -> None:
    log.critical("still not stopped %.0f s after the stop began: exiting now", bound)
    for hook in _overrun_hooks:
        try:
            hook()
        except Exception:  # the exit must happen whatever a hook does
            log.exception("overrun hook %r failed", hook)
    logging.shutdown()
    os._exit(EXIT_OVERRUN)


def arm_shutdown_watchdog(limits: ServerLimits) -> threading.Timer:
    """A daemon timer that ends the process `shutdown_timeout + SHUTDOWN_GRACE` s from now."""
    bound = limits.shutdown_timeout + SHUTDOWN_GRACE
    timer = threading.Timer(bound, _end_overrun, (bound,))
    timer.daemon = True
    timer.start()
    return timer


class CannotListen(click.ClickException):
    """The service's address could not be bound (a port another process holds, a host that does
    not resolve): one line, exit 3, before the service starts any work (uvicorn's own bind error
    would come from inside its task, after the work began)."""

    exit_code = STARTUP_FAILURE


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) for uvicorn to listen on, or CannotListen. Bound by us, before
    the app's start-up, so a taken port is known before a replica leases work or a tracker loads."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise CannotListen(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    # As uvicorn does: a port whose last server's connections linger in TIME_WAIT can be bound again.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise CannotListen(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the service's loop owns the signals

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn exits from inside its task when the app's start-up fails, which tears through the
        # loop (a traceback per task). Here the server just does not start: `started` stays false
        # and serve() exits with the same code once the loop has cleaned up.
        try:
            await super().startup(sockets=sockets)
        except SystemExit:
            self.should_exit = True


def _config(app, host: str, port: int, log_level: str, limits: ServerLimits) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=None,
        http=protocol_class(limits),
        backlog=ACCEPT_BURST,
        timeout_keep_alive=limits.idle_timeout,
        timeout_graceful_shutdown=limits.shutdown_timeout,
    )


async def serve(
    app,
    host: str,
    port: int,
    work: Awaitable[Any] | None = None,
    on_signal: Callable[[], Any] | None = None,
    log_level: str = "warning",
    limits: ServerLimits | None = None,
    bound: Callable[[int], Any] | None = None,
) -> Any:
    """Serve `app` until `work` ends (answering its result), or without `work` until a signal.
    `bound(port)` is told the port once it is bound (port 0: the one the OS picked), before `work`
    starts.

    On SIGTERM or SIGINT: `on_signal()` when given (the service winds down and `work` ends by
    itself), else `work` is cancelled (its CancelledError reaches the caller). The server stops
    after `work`, so /healthz and /metrics answer while the service winds down. CannotListen (exit 3)
    when the port cannot be bound, before `work` starts; without `work`, SystemExit(3) when the
    app's start-up failed, as uvicorn.run exits."""
    limits = limits or ServerLimits()
    try:
        sock = listen(host, port)
    except CannotListen:
        if asyncio.iscoroutine(work):
            work.close()  # never started: no "never awaited" warning on the way out
        raise
    if bound is not None:
        bound(sock.getsockname()[1])
    server = _Server(_config(app, host, port, log_level, limits))
    watchdog: threading.Timer | None = None

    def stop_server() -> None:
        # From here the stop is bounded, whatever the connections or the app's shutdown do.
        nonlocal watchdog
        server.should_exit = True
        if watchdog is None:
            watchdog = arm_shutdown_watchdog(limits)

    http = asyncio.ensure_future(server.serve(sockets=[sock]))
    main = asyncio.ensure_future(work) if work is not None else http
    stop = on_signal or (main.cancel if work is not None else stop_server)
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop)
    try:
        result = await main
    finally:
        # The handlers stay until the loop closes: a second signal while the service cleans up
        # must not kill it half-way (its leases, its hold).
        stop_server()
        try:
            await http
        finally:
            watchdog.cancel()
    if work is None and not server.started:
        raise SystemExit(STARTUP_FAILURE)
    return result


class ThreadedServer:
    """An ASGI app under uvicorn in a background thread: the learner's intake beside its training
    loop, and the stand-in learner of rollout tests. `port=0`: a free port the OS picks; `url` says
    which. CannotListen (exit 3) when the port is taken."""

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        limits: ServerLimits | None = None,
    ) -> None:
        # Bound here, so port 0 is the OS's choice at once: no other process can take it between
        # a draw and the bind (spopp.machine.net's draw is for ports handed to a process not started yet).
        self.sock = listen(host, port)
        port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(_config(app, host, port, log_level, limits or ServerLimits()))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name=f"http-{port}"
        )

    def start(self, timeout: float = 10.0) -> ThreadedServer:
        self.thread.start()
        try:
            wait_until(self._started, timeout, f"the HTTP server on {self.url}", interval=0.01)
        except WaitTimeout:
            raise RuntimeError(f"HTTP server on {self.url} did not start within {timeout:g} s") from None
        return self

    def _started(self) -> bool:
        if not self.server.started and not self.thread.is_alive():
            raise RuntimeError(
                f"HTTP server on {self.url} did not start: its thread ended (the app's start-up failed)"
            )
        return self.server.started

    def serving(self) -> bool:
        """Whether it still answers: its thread runs and it was not told to stop. A loop that died
        (an exception out of uvicorn) closes the socket, so clients get "connection refused"
        while the process that owns the server goes on."""
        return self.thread.is_alive() and not self.server.should_exit

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()  # uvicorn closed it if it started; a server never started must not keep it

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
